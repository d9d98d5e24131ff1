"""DietCode-style auto-scheduler for dynamic-shape operators, usable without the server.

So far: the hardware descriptions the micro-kernel space is built from (``space``), the
shape-dependent half of the cost model (``cost_model.adapt``) and the append-only tuning
records (``database``). Search, measurement and dispatch come with the tuner issue.
"""
