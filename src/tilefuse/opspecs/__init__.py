"""One module per op family, each defining SPECS = [OpSpec(...)]; the registry collects them."""
