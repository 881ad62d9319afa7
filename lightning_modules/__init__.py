"""PyTorch Lightning modules, data modules and the CLI for milgp (imports the library; the library never imports Lightning)."""
