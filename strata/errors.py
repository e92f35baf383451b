"""User-facing errors: one line that names the file, tensor, field or flag and what to do."""


class StrataError(Exception):
    """An error caused by the user's input. The CLI prints it as one line and exits with code 2."""


class ModelFileError(StrataError):
    """A GGUF file that cannot be used: names the file and the problem."""

    def __init__(self, path: object, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedError(StrataError):
    """Something that Strata deliberately does not support (yet)."""
