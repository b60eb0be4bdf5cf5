"""Integrations with the engines users run: each one maps an engine's own graph decisions (its
descriptors, its runtime modes, its padded and unpadded token counts, its capture phase) onto the
recorder's events, through the engine's own extension points and without changing its behaviour."""
