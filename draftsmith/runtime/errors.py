"""The runtime's error for a drafter that cannot draft as asked, below every module that raises it."""


class DrafterError(RuntimeError):
    """A drafter that cannot draft as asked (wrong tree depth, sliding-window cache, ...). One line."""
