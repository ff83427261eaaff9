"""The one exception type for mistakes a user can make; the CLI prints it as one line and exits non-zero."""


class UserError(Exception):
    """A bad config value, missing data, a bad checkpoint: something the user can fix, not a bug."""
