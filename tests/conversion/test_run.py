"""ckptfix.conversion.run: a plan's stream, or why not and the torch path; and the fallback reasons, each once."""

from __future__ import annotations

from ckptfix.conversion.plan import STREAM_FILE, TORCH, Plan
from ckptfix.conversion.run import run, run_conversion
from ckptfix.formats.copyable import Fallback, Reason
from ckptfix.notes import Kind, kind_of
from ckptfix.transforms.checkpoint import Conversion


def test_a_streaming_plan_streams() -> None:
    ran = run(Plan(STREAM_FILE), stream=lambda: "streamed", torch=lambda: "loaded")
    assert (ran.result, ran.why) == ("streamed", None)


def test_a_fallback_runs_torch_and_says_why() -> None:
    def stream() -> str:
        raise Fallback(Reason.INPUT_FORMAT, fmt="torch-legacy")

    ran = run(Plan(STREAM_FILE), stream=stream, torch=lambda: "loaded")
    assert (ran.result, ran.why) == ("loaded", "input is a torch-legacy file")


def test_a_torch_plan_never_streams() -> None:
    def stream() -> Conversion:
        raise AssertionError("a torch plan ran its stream")

    done = run_conversion(Plan(TORCH, "the torch path was asked for"), stream=stream, torch=lambda: Conversion({}))
    assert done.method == "torch"
    assert done.notes == ["fast path not taken: the torch path was asked for"]
    assert kind_of(done.notes[-1]) is Kind.ROUTE


def test_a_stream_says_its_method_and_no_route() -> None:
    done = run_conversion(Plan(STREAM_FILE), stream=lambda: Conversion({}), torch=lambda: Conversion({}))
    assert (done.method, done.notes) == ("stream", [])


def test_each_reason_is_written_once() -> None:
    texts = [reason.value for reason in Reason]
    assert len(texts) == len(set(texts)) == len(Reason.__members__)  # no two names for one text (no alias)
    error = Fallback(Reason.CHUNK_MATH_BIT_VIEW, key="w", bits="conj")
    assert (str(error), error.reason) == ("chunk of 'w' is a conj view: its bytes are not its values", error.reason)
