"""The extension registry: hook specifications, the plugin loader and the typed registries."""
