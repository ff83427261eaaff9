"""The one exception type for mistakes a user can make; the CLI prints it as one line and exits non-zero."""


class UserError(Exception):
    """A bad config value, missing data, a bad checkpoint: something the user can fix, not a bug."""


def one_line(error: UserError) -> str:
    """The error's message; from a DataLoader worker, the original message rather than the worker's traceback."""
    message = str(error)
    if "Original Traceback" in message:
        last = message.strip().splitlines()[-1]
        message = last.split(f"{UserError.__module__}.{UserError.__name__}: ", 1)[-1]
    return message
