"""keel's executor. `from keel.executor import warn` records a warning on the running step
(`step_warnings.warn`): it stays SUCCESS, and `keel run` and `keel status` show the warning."""


def __getattr__(name: str):
    if name == "warn":  # imported on first use: keel.executor's modules import this package first
        from keel.executor.step_warnings import warn

        return warn
    raise AttributeError(f"module 'keel.executor' has no attribute {name!r}")
