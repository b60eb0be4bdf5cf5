"""graph-inspector watch's start-up hook: Python imports this module at start-up in every process
of a watched command (the command put this folder first on PYTHONPATH). It arms the watch, then
runs the sitecustomize it shadows. It never stops the process from starting: a failure is printed.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(os.path.dirname(os.path.dirname(_here)))
if _root not in sys.path:
    sys.path.append(_root)  # last, so the watched program's own modules always win

try:
    from inspector.watch import launch

    launch.arm()
    launch.chain_sitecustomize(_here)
except Exception as exc:  # the watched program must start even when the watch cannot
    print(f"graph-inspector watch: not watching this process: {exc}", file=sys.stderr)
