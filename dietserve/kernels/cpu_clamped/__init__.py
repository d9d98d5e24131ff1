"""The CPU kernel for operators symbolic in both output axes (attention's products): clamped
register tiles, so no tile is padded, copied or bound-checked (``kernel``), optionally with the
row softmax fused in; what it is built with is ``settings.ClampedSettings``."""
