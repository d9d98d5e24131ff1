"""DietCode-style auto-scheduler for dynamic-shape operators, usable without the server."""
