"""Data layer (installed as ``xmc_engine.datasets``)."""
