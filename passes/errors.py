"""The error a pass raises when the recipe asked for something the graph cannot give (e.g. required fusion)."""


class PassError(Exception):
    """The pass manager reports it as a build error naming the pass and the phase."""
