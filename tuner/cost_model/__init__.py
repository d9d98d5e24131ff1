"""DietCode's cost model: f_microkernel (learned, shape-independent) x f_adapt (analytic)."""
