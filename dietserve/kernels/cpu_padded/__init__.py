"""DietCode's CPU micro-kernel (``kernel.apply_cpu``): tiles padded locally, inside each task's
workspace, so the inner loop is the same check-free code for every value of a symbolic dim."""
