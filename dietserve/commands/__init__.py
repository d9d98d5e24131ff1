"""The command line's commands, by role; ``dietserve/__main__.py`` composes them."""
