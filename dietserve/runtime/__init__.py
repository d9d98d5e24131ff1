"""Loaded artifacts and the engine that runs them; no compiler and no transport code here."""
