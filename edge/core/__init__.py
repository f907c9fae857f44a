"""Layer 0: errors, artifacts and manifests, config files, the bundled corpus, external commands.
Imports nothing from the layers above (checked by the import-linter contracts in pyproject.toml)."""
