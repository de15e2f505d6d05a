"""The fp8state command line (the only layer, with the recipe loader, that imports omegaconf)."""
