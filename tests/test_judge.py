"""The built-in `judge` reward against a local OpenAI-compatible stand-in server (no network)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollover.rewards import RewardFailed, RewardRunner, build_rewards
from rollover.types import Prompt


class Judge(BaseHTTPRequestHandler):
    """Grades by the answer's length (`Score: len % 11`); "boom" gets HTTP 500, "mute" a reply
    without a score, "huge" a score past the scale. Records every request body."""

    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Judge.seen.append((self.path, self.headers.get("Authorization"), body))
        message = body["messages"][0]["content"]
        graded = message.split("-----\n", 2)[1].removesuffix("\n") if "-----\n" in message else \
            message.split("Answer to grade:\n", 1)[1].split("\n\n", 1)[0]
        if "slow" in graded:
            time.sleep(3)
        if graded.startswith("reply:"):  # the test chooses the judge's words
            text = graded.removeprefix("reply:").replace("|", "\n")
            reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)
            return
        if "boom" in graded:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"server fell over")
            return
        text = "I cannot say." if "mute" in graded else \
            ("Score: 42" if "huge" in graded else f"Fine work.\nScore: {len(graded) % 11}")
        reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Judge.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def spec(url, **kwargs):
    return {"fn": "judge", "kwargs": {"url": url, "model": "judge-7b", **kwargs}}


def test_the_judges_score_is_mapped_onto_its_scale_and_each_request_carries_the_sample(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    prompts = [Prompt(id="a", text="2+2=", answer="4"),
               Prompt(id="b", messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "3+3="}])]
    completions = ["4", "six, because three and three make six"]
    with RewardRunner(build_rewards([spec(server, rubric="Be strict.")]), timeout_s=30) as runner:
        got = runner.score(prompts, completions)
    for sample, completion in zip(got.samples, completions):
        raw = len(completion) % 11
        assert sample.scores["judge"] == pytest.approx(raw / 10) and sample.extras["judge/raw"] == raw
    assert len(Judge.seen) == 2 and {path for path, _, _ in Judge.seen} == {"/v1/chat/completions"}
    assert all(auth == "Bearer sk-test" for _, auth, _ in Judge.seen)
    by_answer = {body["messages"][0]["content"].split("-----\n")[1].rstrip("\n"): body for _, _, body in Judge.seen}
    first, second = by_answer["4"], by_answer[completions[1]]
    assert first["model"] == "judge-7b" and first["temperature"] == 0.0
    assert "Question:\n2+2=" in first["messages"][0]["content"] and "Reference answer:\n4" in first["messages"][0]["content"]
    assert "Be strict." in first["messages"][0]["content"]
    assert "system: Be terse.\nuser: 3+3=" in second["messages"][0]["content"]
    assert "Reference answer" not in second["messages"][0]["content"]  # the sample has none


def test_a_failed_request_fails_its_sample_only_with_the_reason(server):
    prompts = [Prompt(id=str(i), text="q", answer="a") for i in range(4)]
    completions = ["fine", "boom", "mute", "huge"]
    with RewardRunner(build_rewards([spec(server, concurrency=2)]), timeout_s=30, on_error="skip") as runner:
        got = runner.score(prompts, completions)
    assert got.samples[0].status == "ok" and got.samples[0].scores["judge"] == pytest.approx(0.4)
    assert [s.status for s in got.samples[1:]] == ["skipped"] * 3
    errors = {f.sample_id: f.error for f in got.failures}
    assert "HTTP 500: server fell over" in errors["1#1"]
    assert "does not end with a `Score: N` line: 'I cannot say.'" in errors["2#2"]
    assert "outside its scale [0, 10]" in errors["3#3"]
    assert got.error_counts["judge"] == 3
    with RewardRunner(build_rewards([spec(server)]), timeout_s=30) as runner:  # on_error=raise
        with pytest.raises(RewardFailed, match="HTTP 500"):
            runner.score(prompts[:2], completions[:2])


def test_an_unreachable_judge_and_bad_settings_are_named(tmp_path):
    with RewardRunner(build_rewards([spec("http://127.0.0.1:9/v1", request_timeout_s=2)]), timeout_s=30,
                      on_error="zero") as runner:
        got = runner.score([Prompt(id="a", text="q")], ["x"])
    assert got.failures and "127.0.0.1:9/v1/chat/completions" in got.failures[0].error
    with pytest.raises(ValueError, match=r"kwargs \['model'\] required"):
        build_rewards([{"fn": "judge", "kwargs": {"url": "http://x/v1"}}])
    with pytest.raises(ValueError, match=r"scale=\[5, 1\]: expected \[low, high\]"):
        build_rewards([spec("http://x/v1", scale=[5, 1])])
    with pytest.raises(ValueError, match=r"template: KeyError\('question'\)"):
        build_rewards([spec("http://x/v1", template="{question}")])
    with pytest.raises(ValueError, match=r"url='localhost:8000': expected http"):
        build_rewards([spec("localhost:8000")])


def test_a_template_of_ones_own_and_another_scale(server):
    template = "Q: {prompt}\nGold: {answer}\nAnswer to grade:\n{completion}\n\nRate {low}-{high}."
    with RewardRunner(build_rewards([spec(server, template=template, scale=[1, 5])]), timeout_s=30,
                      on_error="skip") as runner:
        got = runner.score([Prompt(id="a", text="2+2=", answer="4")], ["4"])  # length 1: Score 1 -> 0.0
    assert got.samples[0].scores["judge"] == 0.0
    assert Judge.seen[0][2]["messages"][0]["content"] == "Q: 2+2=\nGold: 4\nAnswer to grade:\n4\n\nRate 1-5."


@pytest.mark.parametrize("reply,raw", [
    ("Fine.|Score: 7", 7.0), ("**Score:** 7/10", 7.0), ("Score = 6.5", 6.5),
    ("Score: 7|Confidence score: 0.9", None),  # the last line is not the score
    ("Score: 3 (a score: 10 would be perfect)", None), ("The answer says Score: 10.|Not convinced.", None),
])
def test_only_a_last_line_of_the_form_score_n_is_read(server, reply, raw):
    with RewardRunner(build_rewards([spec(server)]), timeout_s=30, on_error="skip") as runner:
        got = runner.score([Prompt(id="a", text="q")], ["reply:" + reply]).samples[0]
    if raw is None:
        assert got.status == "skipped"
    else:
        assert got.extras["judge/raw"] == raw


def test_the_batch_keeps_what_was_graded_when_its_time_runs_out(server):
    """reward.timeout_s bounds the whole batch: samples graded in time keep their scores, the
    rest fail with a timeout each (not the whole batch)."""
    prompts = [Prompt(id=str(i), text="q") for i in range(4)]
    completions = ["ok", "slow", "fine", "slow too"]
    with RewardRunner(build_rewards([spec(server, concurrency=4)]), timeout_s=2.5, on_error="skip") as runner:
        got = runner.score(prompts, completions)
    assert [s.status for s in got.samples] == ["ok", "skipped", "ok", "skipped"]
    assert all("not graded within the batch's time (reward.timeout_s=2.5 s" in f.error for f in got.failures)
