"""grpo's runner for a VeRL `custom_reward_function`: the user's Python file, unchanged, called
as VeRL's reward managers call it.

    python -u -c SOURCE PATH NAME REWARD_KWARGS_JSON MANAGER [--check]

PATH is a file (or `file://...`, or `pkg://dotted.module` as VeRL's `load_module` takes it),
NAME its function, MANAGER `naive` (VeRL's default manager: one call per response,
`compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)`) or
`batch` (VeRL's batch manager: lists, `compute_score(data_sources=, solution_strs=,
ground_truths=, extra_infos=, **reward_kwargs)`, returning one result per response).
Coroutine functions are run to completion. `--check` loads the function and exits.

It speaks grpo's external-scorer protocol: one request per line on stdin
(`{"id", "data_source", "response", "ground_truth", "extra", ...}`, where `extra` holds the
row's other columns and VeRL's `extra_info` is its `extra_info` column), one answer per line
on stdout: `{"id", "score", "extras", "pred"}` from a number or from a dict with a `score`
(its other numeric keys become extras, a string `pred` the prediction), or `{"id", "error"}`
when the function raised or returned something else. Whatever the user's code prints goes to
stderr.
"""
import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import select
import sys
import traceback

PROTOCOL = os.fdopen(os.dup(1), "w")
sys.stdout = sys.stderr

# Requests a batch call takes at most (those already waiting on stdin).
MAX_BATCH = 256


def load(path, name):
    if path.startswith("pkg://"):
        module = importlib.import_module(path[len("pkg://"):].replace("/", "."))
    else:
        if path.startswith("file://"):
            path = path[len("file://"):]
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such file: {path}")
        spec = importlib.util.spec_from_file_location(f"custom_module_{hash(os.path.abspath(path))}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load a Python module from {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if not hasattr(module, name):
        functions = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise AttributeError(f"{path} has no `{name}` (it defines: {', '.join(functions) or 'nothing callable'})")
    return getattr(module, name)


def run(fn, kwargs):
    result = fn(**kwargs)
    if inspect.isawaitable(result):
        async def wait():
            return await result

        result = asyncio.run(wait())
    return result


def answer_for(request_id, result, name):
    def number(value, what):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} returned {what}{value!r} ({type(value).__name__}); VeRL's reward "
                            "functions return a number or a dict with a numeric `score`")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} returned {what}{value}, which is not finite")
        return value

    if isinstance(result, dict):
        if "score" not in result:
            raise KeyError(f"{name} returned a dict without `score` (keys: {', '.join(map(str, result))})")
        answer = {"id": request_id, "score": number(result["score"], "the score "), "extras": {}}
        for key, value in result.items():
            if key == "score":
                continue
            if key == "pred" and isinstance(value, str):
                answer["pred"] = value
            elif isinstance(value, (bool, numbers.Real)) and math.isfinite(float(value)):
                answer["extras"][str(key)] = float(value)
        return answer
    return {"id": request_id, "score": number(result, "")}


def error_for(request_id, error):
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return {"id": request_id, "error": f"{type(error).__name__}: {error}{where}"}


def extra_info(request):
    info = (request.get("extra") or {}).get("extra_info")
    info = dict(info) if isinstance(info, dict) else {}
    # What VeRL's managers add to every extra_info.
    info.setdefault("num_turns", None)
    info.setdefault("rollout_reward_scores", {})
    return info


class Lines:
    """Request lines from stdin, read from the file descriptor itself so that "is another
    request waiting?" sees everything that has arrived (a buffered reader would hide lines)."""

    def __init__(self):
        self.buffer = b""
        self.closed = False

    def next(self, wait=True):
        while b"\n" not in self.buffer:
            if self.closed or (not wait and not select.select([0], [], [], 0)[0]):
                return None
            chunk = os.read(0, 1 << 16)
            if not chunk:
                self.closed = True
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def reply(answer):
    PROTOCOL.write(json.dumps(answer) + "\n")
    PROTOCOL.flush()


def main():
    path, name, reward_kwargs, manager = sys.argv[1:5]
    reward_kwargs = json.loads(reward_kwargs)
    fn = load(path, name)
    if "--check" in sys.argv[5:]:
        return
    lines = Lines()
    while True:
        first = lines.next()
        if first is None:
            return
        requests = [first]
        if manager == "batch":
            # Whatever else is already waiting joins the batch.
            while len(requests) < MAX_BATCH:
                more = lines.next(wait=False)
                if more is None:
                    break
                requests.append(more)
            try:
                results = run(fn, dict(
                    data_sources=[r["data_source"] for r in requests],
                    solution_strs=[r["response"] for r in requests],
                    ground_truths=[r["ground_truth"] for r in requests],
                    extra_infos=[extra_info(r) for r in requests],
                    **reward_kwargs,
                ))
                if not isinstance(results, (list, tuple)) or len(results) != len(requests):
                    raise TypeError(f"{name} returned {type(results).__name__} for {len(requests)} responses; "
                                    "VeRL's batch manager expects a list with one result per response")
            except Exception as error:  # noqa: BLE001 - every failure is the user's code's
                for r in requests:
                    reply(error_for(r["id"], error))
                continue
            for r, result in zip(requests, results):
                try:
                    reply(answer_for(r["id"], result, name))
                except Exception as error:  # noqa: BLE001
                    reply(error_for(r["id"], error))
        else:
            r = requests[0]
            try:
                result = run(fn, dict(
                    data_source=r["data_source"],
                    solution_str=r["response"],
                    ground_truth=r["ground_truth"],
                    extra_info=extra_info(r),
                    **reward_kwargs,
                ))
                reply(answer_for(r["id"], result, name))
            except Exception as error:  # noqa: BLE001
                reply(error_for(r["id"], error))


if __name__ == "__main__":
    main()
