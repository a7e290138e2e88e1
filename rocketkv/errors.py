"""The engine's one error type for bad user input."""


class ConfigError(ValueError):
    """Bad user input (config, checkpoint, CLI value). The CLI prints it as one line, exit 2."""
