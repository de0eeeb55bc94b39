"""A test module's independent subprocess runs, started ahead two at a time so that they overlap.

Most of such a run is one core importing torch / DeepSpeed / Megatron-Core, and the suite runs its tests one
after the other: the machine's second core idles meanwhile. A module lists its runs by the name of the test
that checks each; the fixture starts those of the selected tests, in that order, two at a time, and each test
takes its run's result (or its exception) and asserts on it as before.

    @pytest.fixture(scope="module")
    def ahead(request, tmp_path_factory):
        with RunsAhead(request, {"test_a": lambda: run_a(tmp_path_factory.mktemp("a"))}) as runs:
            yield runs

    def test_a(ahead):
        out = ahead.result("test_a")
"""

from concurrent.futures import ThreadPoolExecutor


class RunsAhead:
    def __init__(self, request, runs: dict, needed_by: dict | None = None, workers: int = 2):
        """``runs``: {name: a callable doing the run}, a name being the test (function or parametrized id) that
        checks it, or one named in ``needed_by`` {name: test names}. Only the runs of selected tests start."""
        selected = set()
        for item in request.session.items:
            if item.module is request.module:
                selected |= {item.name, item.originalname}
        needed_by = needed_by or {}
        self._runs = runs
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="run-ahead")
        self._futures = {name: self._pool.submit(run) for name, run in runs.items()
                         if selected & {name, *needed_by.get(name, ())}}

    def result(self, name: str):
        """The run's result, or the exception it raised; a run not started ahead runs now."""
        if name not in self._futures:
            self._futures[name] = self._pool.submit(self._runs[name])
        return self._futures[name].result()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # Runs not started yet (their tests failed earlier or were interrupted) are dropped; running ones end
        # within their own timeouts.
        self._pool.shutdown(wait=True, cancel_futures=True)
