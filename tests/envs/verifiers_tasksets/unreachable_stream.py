"""An infinite verifiers v1 taskset whose rows live on a dataset hub this machine cannot reach (as upstream
alphabet_sort without its Hub dataset): the loader fails when the first task is taken, nothing is downloaded."""

import verifiers.v1 as vf


def hub_rows(dataset: str):
    raise ConnectionError(f"cannot reach the dataset hub for {dataset!r} (offline)")


class UnreachableStream(vf.Taskset):
    INFINITE = True

    def load(self):
        for row in hub_rows("example/unreachable-rows"):
            yield vf.Task(vf.TaskData(prompt=row["prompt"]), self.config.task)


__all__ = ["UnreachableStream"]
