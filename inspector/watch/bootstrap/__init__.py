"""The folder ``graph-inspector watch`` puts first on PYTHONPATH; it holds only ``sitecustomize``.

A package only so that installing graph-inspector (not just an editable checkout) ships it.
"""
