"""DietCode's cost model: f_microkernel (learned, shape-independent) x f_adapt (analytic)."""

from .adapt import adapt_factor, core_occupancy, kernel_instances, padding_efficiency

__all__ = ["adapt_factor", "core_occupancy", "kernel_instances", "padding_efficiency"]
