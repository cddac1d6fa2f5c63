"""`trace-rl view RUN --step N`: the step's episodes as a static page, opened in headless Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest

from flows.cli import main
from tests.algorithms.helpers import chat_branch, make_trace, run
from trace_rl.algorithms import load_algorithm
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.config import Config, config_to_toml
from trace_rl.storage import RunStorage, record_run_version
from trace_rl.tables import write_channels, write_traces

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's `chromium` is not installed (apt-get install "
                                    "-y chromium; .ci/run installs it)")
SECRET = "sk-episode-page-secret-0123456789"


def tool_episode(trace_id: str, reward: float):
    """system, user, an assistant turn calling a tool, its result, the final answer: the two turns sampled."""
    messages = [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": f"weather in Oslo? {SECRET}"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [{"id": "c1", "name": "forecast", "arguments": {"city": "Oslo"}}]},
        {"role": "tool", "content": "rain <b>12 mm</b>", "name": "forecast", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Rain."}]
    branch = chat_branch([(0, 2, False), (1, 3, False), (2, 3, True), (3, 4, False), (4, 2, True)])
    return make_trace(trace_id, messages, [branch], reward=reward, agent="policy-agent")


class Page(HTMLParser):
    """What a reader sees: per episode section, its message roles, tool calls and token spans (style, title)."""

    def __init__(self):
        super().__init__()
        self.sections: list[dict] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "section":
            self.sections.append({"id": attrs["id"], "roles": [], "calls": [], "tokens": []})
        elif "message" in classes:
            self.sections[-1]["roles"].append(attrs["data-role"])
        elif "tool-call" in classes:
            self.sections[-1]["calls"].append(attrs["data-tool"])
        elif "tok" in classes:
            self.sections[-1]["tokens"].append((attrs.get("style") or "", attrs["title"], "untrained" in classes))


@pytest.fixture(scope="module")
def viewed_run(tmp_path_factory, tiny_model_path):
    """A run of one step: two tool episodes (rewards 1 and 0) with a grpo (rl) and an sft (ce, on the second) channel
    saved as the pipeline saves them, its page written by `trace-rl view`."""
    root = tmp_path_factory.mktemp("view")
    config = Config(name="viewed", storage=str(root), env=[{"id": "reverse-text"}], model={"name": tiny_model_path})
    storage = RunStorage.of(config)
    storage.write_atomic(storage.path("config.toml"), config_to_toml(config).encode())
    record_run_version(storage)
    traces = [tool_episode("good", 1.0), tool_episode("bad", 0.0)]
    write_traces(storage, 1, traces)
    grpo = run(apply_algorithm(load_algorithm("grpo"), traces))
    sft = run(apply_algorithm(load_algorithm({"id": "sft", "weight": 0.5}), traces[1:]))
    write_channels(storage, storage.step_path(1, "channels/00-grpo.parquet"), grpo)
    write_channels(storage, storage.step_path(1, "channels/01-sft.parquet"), sft)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EPISODE_PAGE_API_KEY", SECRET)  # a credential the run's environment holds: redacted on the page
        assert main(["view", storage.url, "--step", "1"]) == 0
    return storage, traces


def test_view_refuses_a_step_without_traces_in_one_line(viewed_run, capsys):
    storage, _ = viewed_run
    assert main(["view", storage.url, "--step", "7"]) == 2
    assert capsys.readouterr().err == f"error: --step 7: {storage.url} has no saved traces of that step (saved: 1)\n"


@needs_chromium
def test_the_page_in_headless_chromium_shows_roles_tool_calls_and_each_tokens_signal(viewed_run, tmp_path):
    storage, traces = viewed_run
    page = storage.step_path(1, "episodes.html")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", f"file://{page}"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    parsed = Page()
    parsed.feed(dom)
    assert [s["id"] for s in parsed.sections] == ["good", "bad"]
    assert SECRET not in dom and "[secret]" in dom
    assert "tool result of forecast (call c1)" in dom and "rain &lt;b&gt;12 mm&lt;/b&gt;" in dom  # shown as text
    for section, trace in zip(parsed.sections, traces):
        assert section["roles"] == ["system", "user", "assistant", "tool", "assistant"]
        assert section["calls"] == ["forecast"]
        (branch,) = trace.branches
        assert len(section["tokens"]) == len(branch)  # every token, in order
        for t, (style, title, untrained) in enumerate(section["tokens"]):
            assert title.startswith(f"token {branch.token_ids[t]}")
            trained = bool(branch.sampled[t]) and t > 0
            assert untrained == (not trained) and (style == "") == (not trained)
            if branch.sampled[t]:
                assert f"sampler logprob {branch.logprobs[t]:.6g}" in title
    # grpo: the good episode +0.5 on its sampled tokens, the bad one -0.5 plus sft's ce weight 0.5
    good, bad = parsed.sections
    sampled = np.flatnonzero(traces[0].branches[0].sampled)
    for t in sampled:
        assert "advantage 0.5" in good["tokens"][t][1] and "rgba(40, 170, 40" in good["tokens"][t][0]
        assert "advantage -0.5 | ce weight 0.5" in bad["tokens"][t][1] and "rgba(220, 40, 40" in bad["tokens"][t][0]

    shot = tmp_path / "page.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1000,1400", f"--screenshot={shot}", f"file://{page}"],
                   capture_output=True, timeout=120, check=True)
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(int)
    greenish = (pixels[:, 1] > pixels[:, 0] + 40) & (pixels[:, 1] > pixels[:, 2] + 40)
    reddish = (pixels[:, 0] > pixels[:, 1] + 40) & (pixels[:, 0] > pixels[:, 2] + 40)
    assert greenish.sum() > 200 and reddish.sum() > 200  # the coloured tokens are drawn


def test_the_page_says_the_trainer_logprobs_are_not_stored(viewed_run):
    storage, _ = viewed_run
    text = storage.read_bytes(storage.step_path(1, "episodes.html")).decode()
    assert re.search(r"Trainer logprobs are not stored with the step: the hover shows the sampler's", text)


def test_rescore_shows_the_trainer_logprob_and_the_gap_by_the_weights_the_step_trained_from(viewed_run,
                                                                                            tiny_model_path):
    from tests.envs.test_verifiers_env import recomputed_logprobs

    storage, traces = viewed_run
    assert main(["view", storage.url, "--step", "1", "--rescore"]) == 0
    parsed = Page()
    parsed.feed(storage.read_bytes(storage.step_path(1, "episodes.html")).decode())
    (branch,) = traces[0].branches  # step 1 trains from the base model; the logprobs written are -0.5
    expected = recomputed_logprobs(tiny_model_path, branch.token_ids, branch.temperature)
    for t in np.flatnonzero(branch.sampled):
        title = parsed.sections[0]["tokens"][t][1]
        assert f"trainer logprob {expected[t]:.6g}, gap {expected[t] + 0.5:.3g}" in title
    assert all("trainer logprob" not in title for _, title, _ in parsed.sections[0]["tokens"][:3])  # prompt tokens
