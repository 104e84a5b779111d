"""The error raised for model files that cannot be loaded."""


class WeightsError(ValueError):
    """A model file that jaxlora cannot load; the message names the file and the problem."""
