"""The producer's durable prompt cursor (producer/cursor.py) and the plan of
jobs built on it (producer/source.py): ids, restoring from the `CURSOR`
file, its refusals, its compaction, and the order `Plan.jobs` issues in.
Expected values are written out by hand."""
import json

import numpy as np
import pytest

import rollstream.producer.cursor as cursor_module
from rollstream.common.errors import InvalidInput
from rollstream.producer.cursor import FILE, CursorError, PromptCursor
from rollstream.producer.source import Job, Plan, Prompts


def three_prompts() -> Prompts:
    """Prompts 0, 1 and 2, each the one token of its index."""
    return Prompts(lambda p: (np.array([p], np.int32), None) if p < 3 else None, "three")


def kept(directory, *, prompts="three", group_size=2, producer_id="prod") -> PromptCursor:
    return PromptCursor(directory, producer_id, prompts=prompts, group_size=group_size)


def recorded(directory, *, issued, finished=()) -> PromptCursor:
    """A kept cursor that issued and then finished those samples, closed."""
    cursor = kept(directory)
    for sample in issued:
        cursor.issued(sample)
    for sample in finished:
        cursor.finished(sample)
    cursor.close()
    return cursor


def lines_of(directory) -> list[str]:
    return (directory / FILE).read_text(encoding="utf-8").splitlines()


# -- ids, without a directory ----------------------------------------------------

def test_a_cursor_without_a_directory_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cursor = PromptCursor(None, "prod", prompts="three", group_size=2)
    assert cursor.restored is False
    assert cursor.path is None
    assert cursor.next == (0, 0) and cursor.outstanding == set()
    cursor.issued((0, 0))
    cursor.issued((0, 1))
    cursor.finished((0, 0))
    cursor.close()
    assert cursor.next == (1, 0) and cursor.outstanding == {(0, 1)}
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere


def test_ids_follow_from_the_stem_prompt_and_sample():
    cursor = PromptCursor(None, "prod", prompts="three", group_size=2)
    stem = cursor.stem
    assert stem.startswith("prod-") and len(stem) > len("prod-")
    assert cursor.trajectory_id((3, 1)) == f"{stem}-3-1"
    assert cursor.trajectory_id((0, 0)) == f"{stem}-0-0"
    assert cursor.group_id(3) == f"{stem}-3"
    assert cursor.group_id(12) == f"{stem}-12"


def test_two_fresh_cursors_draw_different_run_tokens():
    stems = {PromptCursor(None, "prod", prompts="three", group_size=2).stem for _ in range(4)}
    assert len(stems) == 4


def test_sample_of_maps_its_own_ids_back():
    cursor = PromptCursor(None, "prod", prompts="three", group_size=2)
    stem = cursor.stem
    assert cursor.sample_of(f"{stem}-3-1") == (3, 1)
    assert cursor.sample_of(f"{stem}-0-0") == (0, 0)
    assert cursor.sample_of(f"{stem}-120-7") == (120, 7)


def test_sample_of_a_producer_id_with_dashes():
    cursor = PromptCursor(None, "node-7-src", prompts="three", group_size=2)
    assert cursor.sample_of(f"{cursor.stem}-4-1") == (4, 1)


@pytest.mark.parametrize("suffix", ["-x-1", "-3-y", "-3", "--1", "-3-", "-3--1", "-3-1-2", "-3-1x", ""])
def test_sample_of_refuses_ids_not_its_own_shape(suffix):
    cursor = PromptCursor(None, "prod", prompts="three", group_size=2)
    assert cursor.sample_of(f"{cursor.stem}{suffix}") is None


def test_sample_of_refuses_other_stems():
    cursor = PromptCursor(None, "prod", prompts="three", group_size=2)
    other_run = PromptCursor(None, "prod", prompts="three", group_size=2)
    other_producer = PromptCursor(None, "other", prompts="three", group_size=2)
    assert cursor.sample_of(other_run.trajectory_id((3, 1))) is None  # same producer, another run token
    assert cursor.sample_of(other_producer.trajectory_id((3, 1))) is None
    run = cursor.stem.removeprefix("prod-")
    assert cursor.sample_of(f"other-{run}-3-1") is None  # another producer's id with the same token
    assert cursor.sample_of(f"xprod-{run}-3-1") is None
    assert cursor.sample_of("3-1") is None
    assert cursor.sample_of("") is None


def test_after_walks_the_samples_of_a_prompt_then_the_next_prompt():
    cursor = PromptCursor(None, "prod", prompts="three", group_size=3)
    assert cursor.after((0, 0)) == (0, 1)
    assert cursor.after((0, 1)) == (0, 2)
    assert cursor.after((0, 2)) == (1, 0)
    assert cursor.after((5, 2)) == (6, 0)
    single = PromptCursor(None, "prod", prompts="three", group_size=1)
    assert single.after((0, 0)) == (1, 0)
    assert single.after((7, 0)) == (8, 0)


def test_issued_advances_next_only_past_the_highest_issued():
    cursor = PromptCursor(None, "prod", prompts="three", group_size=2)
    cursor.issued((1, 1))
    assert cursor.next == (2, 0)
    cursor.issued((0, 1))  # an earlier sample issued again (an outstanding one) moves nothing back
    assert cursor.next == (2, 0)
    assert cursor.outstanding == {(1, 1), (0, 1)}


# -- kept in a directory ---------------------------------------------------------

def test_a_new_cursor_writes_its_header(tmp_path):
    cursor = kept(tmp_path)
    cursor.close()
    assert cursor.restored is False
    lines = lines_of(tmp_path)
    assert len(lines) == 1
    header = json.loads(lines[0])
    assert header["prompts"] == "three" and header["group_size"] == 2
    assert header["next"] == [0, 0] and header["outstanding"] == []
    assert cursor.stem == f"prod-{header['run']}"


def test_issued_and_finished_lines_are_appended(tmp_path):
    recorded(tmp_path, issued=[(0, 0), (0, 1)], finished=[(0, 0)])
    assert lines_of(tmp_path)[1:] == ['{"i":[0,0]}', '{"i":[0,1]}', '{"d":[0,0]}']


def test_a_restored_cursor_goes_on_where_the_last_one_stopped(tmp_path):
    first = kept(tmp_path)
    for sample in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]:
        first.issued(sample)
    first.finished((0, 0))
    first.finished((1, 0))
    first.finished((0, 1))
    first.close()

    again = kept(tmp_path)
    assert again.restored is True
    assert again.stem == first.stem  # the run token is kept: the same ids
    assert again.trajectory_id((1, 1)) == first.trajectory_id((1, 1))
    assert again.next == (2, 1)  # the sample after (2, 0), the highest issued
    assert again.outstanding == {(1, 1), (2, 0)}
    assert again.sample_of(first.trajectory_id((2, 0))) == (2, 0)
    again.close()


def test_restoring_twice_keeps_the_state(tmp_path):
    first = recorded(tmp_path, issued=[(0, 0), (0, 1)], finished=[(0, 1)])
    kept(tmp_path).close()  # restored and written anew, nothing issued
    third = kept(tmp_path)
    assert third.restored is True and third.stem == first.stem
    assert third.next == (1, 0) and third.outstanding == {(0, 0)}
    third.close()


def test_a_restored_cursor_compacts_the_file_into_its_header(tmp_path):
    recorded(tmp_path, issued=[(0, 0), (0, 1)], finished=[(0, 0)])
    kept(tmp_path).close()
    lines = lines_of(tmp_path)
    assert len(lines) == 1
    header = json.loads(lines[0])
    assert header["next"] == [1, 0] and header["outstanding"] == [[0, 1]]


def test_records_after_a_restore_go_on_from_the_restored_state(tmp_path):
    first = kept(tmp_path)
    first.issued((0, 0))
    first.issued((0, 1))
    first.close()
    second = kept(tmp_path)
    second.issued((0, 0))  # an outstanding sample issued again, then finished
    second.finished((0, 0))
    second.issued((1, 0))
    second.close()
    third = kept(tmp_path)
    assert third.next == (1, 1)
    assert third.outstanding == {(0, 1), (1, 0)}
    third.close()


def test_a_finished_sample_issued_again_in_the_file_is_outstanding(tmp_path):
    cursor = kept(tmp_path)
    cursor.close()
    with (tmp_path / FILE).open("a", encoding="utf-8") as out:
        out.write('{"i":[0,0]}\n{"d":[0,0]}\n{"i":[0,0]}\n')
    again = kept(tmp_path)
    assert again.outstanding == {(0, 0)} and again.next == (0, 1)
    again.close()


def test_another_prompts_identity_refuses(tmp_path):
    kept(tmp_path, prompts="three").close()
    with pytest.raises(CursorError) as refused:
        kept(tmp_path, prompts="four")
    message = str(refused.value)
    assert "'three'" in message and "'four'" in message
    assert "prompts" in message and "expected" in message
    assert str(tmp_path / FILE) in message
    assert isinstance(refused.value, InvalidInput)


def test_another_group_size_refuses(tmp_path):
    kept(tmp_path, group_size=2).close()
    with pytest.raises(CursorError) as refused:
        kept(tmp_path, group_size=4)
    message = str(refused.value)
    assert "group_size 2" in message and "4" in message
    assert "expected" in message
    assert str(tmp_path / FILE) in message


def test_a_refused_cursor_leaves_the_file_alone(tmp_path):
    first = kept(tmp_path)
    first.issued((0, 0))
    first.close()
    before = (tmp_path / FILE).read_bytes()
    with pytest.raises(CursorError):
        kept(tmp_path, group_size=3)
    assert (tmp_path / FILE).read_bytes() == before
    again = kept(tmp_path)
    assert again.outstanding == {(0, 0)}
    again.close()


def test_a_torn_last_line_is_ignored(tmp_path):
    first = kept(tmp_path)
    first.issued((0, 0))
    first.issued((0, 1))
    first.close()
    with (tmp_path / FILE).open("a", encoding="utf-8") as out:
        out.write('{"d":[0,')  # a crash mid-write: no end of line
    again = kept(tmp_path)
    assert again.restored is True and again.stem == first.stem
    assert again.next == (1, 0)
    assert again.outstanding == {(0, 0), (0, 1)}  # the torn finish was never acted on
    again.close()
    assert all(json.loads(line) for line in lines_of(tmp_path))  # the torn line is gone


def test_a_torn_line_after_the_header_alone_is_ignored(tmp_path):
    kept(tmp_path).close()
    with (tmp_path / FILE).open("a", encoding="utf-8") as out:
        out.write('{"i":[0')
    again = kept(tmp_path)
    assert again.restored is True
    assert again.next == (0, 0) and again.outstanding == set()
    again.close()


def test_a_damaged_line_before_the_last_refuses(tmp_path):
    first = kept(tmp_path)
    first.issued((0, 0))
    first.close()
    with (tmp_path / FILE).open("a", encoding="utf-8") as out:
        out.write('{"d":[0,\n{"i":[0,1]}\n')
    with pytest.raises(CursorError) as refused:
        kept(tmp_path)
    message = str(refused.value)
    assert f"{tmp_path / FILE}:3:" in message  # header, the issue, then the damaged third line
    assert "JSON" in message


def test_a_damaged_header_refuses(tmp_path):
    first = kept(tmp_path)
    first.issued((0, 0))
    first.close()
    lines = lines_of(tmp_path)
    (tmp_path / FILE).write_text("\n".join([lines[0][:10], *lines[1:]]) + "\n", encoding="utf-8")
    with pytest.raises(CursorError, match=":1:"):
        kept(tmp_path)


def test_an_empty_file_refuses(tmp_path):
    (tmp_path / FILE).write_text("", encoding="utf-8")
    with pytest.raises(CursorError, match="empty file"):
        kept(tmp_path)


def test_a_file_of_a_torn_line_alone_refuses(tmp_path):
    (tmp_path / FILE).write_text('{"run":"ab', encoding="utf-8")
    with pytest.raises(CursorError, match="header"):
        kept(tmp_path)


def test_a_headerless_file_refuses(tmp_path):
    (tmp_path / FILE).write_text('{"i":[0,0]}\n{"d":[0,0]}\n', encoding="utf-8")
    with pytest.raises(CursorError) as refused:
        kept(tmp_path)
    assert "header" in str(refused.value)


def test_a_header_missing_a_field_refuses(tmp_path):
    header = {"run": "abcd1234", "prompts": "three", "group_size": 2, "next": [0, 0]}  # no outstanding
    (tmp_path / FILE).write_text(json.dumps(header) + "\n", encoding="utf-8")
    with pytest.raises(CursorError, match="header"):
        kept(tmp_path)


def test_a_hand_written_header_is_restored(tmp_path):
    header = {"run": "abcd1234", "prompts": "three", "group_size": 2, "next": [4, 1], "outstanding": [[3, 0], [4, 0]]}
    (tmp_path / FILE).write_text(json.dumps(header) + '\n{"d":[3,0]}\n{"i":[4,1]}\n', encoding="utf-8")
    cursor = kept(tmp_path)
    assert cursor.stem == "prod-abcd1234"
    assert cursor.trajectory_id((4, 1)) == "prod-abcd1234-4-1"
    assert cursor.next == (5, 0)
    assert cursor.outstanding == {(4, 0), (4, 1)}
    cursor.close()


def test_the_file_is_compacted_once_the_lines_outgrow_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(cursor_module, "_REWRITE_FROM_LINES", 5)
    cursor = kept(tmp_path, group_size=4)
    for prompt in range(10):  # 40 samples, each issued and finished except (p, 3): 80 lines in all
        for index in range(4):
            cursor.issued((prompt, index))
        for index in range(3):
            cursor.finished((prompt, index))
    assert cursor.outstanding == {(p, 3) for p in range(10)}
    cursor.close()
    lines = lines_of(tmp_path)
    # Outstanding: 10 samples, so the bound is 2 * 10 = 20 lines past the header.
    assert len(lines) <= 1 + 20
    assert not (tmp_path / (FILE + ".new")).exists()
    again = kept(tmp_path, group_size=4)
    assert again.next == (10, 0)
    assert again.outstanding == {(0, 3), (1, 3), (2, 3), (3, 3), (4, 3), (5, 3), (6, 3), (7, 3), (8, 3), (9, 3)}
    assert again.stem == cursor.stem
    again.close()


def test_compaction_with_little_outstanding_keeps_the_file_short(tmp_path, monkeypatch):
    monkeypatch.setattr(cursor_module, "_REWRITE_FROM_LINES", 5)
    cursor = kept(tmp_path, group_size=2)
    for prompt in range(50):
        for index in range(2):
            cursor.issued((prompt, index))
            cursor.finished((prompt, index))
    cursor.issued((50, 0))
    cursor.close()
    assert len(lines_of(tmp_path)) <= 1 + 5
    assert not (tmp_path / (FILE + ".new")).exists()
    again = kept(tmp_path, group_size=2)
    assert again.next == (50, 1)
    assert again.outstanding == {(50, 0)}
    again.close()


# -- Plan ------------------------------------------------------------------------

def described(jobs) -> list[tuple]:
    return [(job.prompt, job.member, job.trajectory_id, job.group_id, job.group_size, int(job.prompt_tokens[0]))
            for job in jobs]


def test_plan_yields_every_sample_of_every_prompt_in_order():
    cursor = PromptCursor(None, "prod", prompts="three", group_size=2)
    s = cursor.stem
    jobs = list(Plan(three_prompts(), cursor, group_size=2, limit=0).jobs(first=[]))
    assert [job.sample_index for job in jobs] == [0, 1, 2, 3, 4, 5]  # over the run: prompt times group size plus member
    assert described(jobs) == [
        (0, 0, f"{s}-0-0", f"{s}-0", 2, 0),
        (0, 1, f"{s}-0-1", f"{s}-0", 2, 0),
        (1, 0, f"{s}-1-0", f"{s}-1", 2, 1),
        (1, 1, f"{s}-1-1", f"{s}-1", 2, 1),
        (2, 0, f"{s}-2-0", f"{s}-2", 2, 2),
        (2, 1, f"{s}-2-1", f"{s}-2", 2, 2),
    ]
    assert all(job.resumable is None and job.prefix is None and job.metadata is None for job in jobs)


def test_plan_of_single_samples_has_no_groups():
    cursor = PromptCursor(None, "prod", prompts="three", group_size=1)
    s = cursor.stem
    jobs = list(Plan(three_prompts(), cursor, group_size=1, limit=0).jobs(first=[]))
    assert described(jobs) == [(0, 0, f"{s}-0-0", None, None, 0), (1, 0, f"{s}-1-0", None, None, 1),
                               (2, 0, f"{s}-2-0", None, None, 2)]


@pytest.mark.parametrize("limit, samples", [
    (1, [(0, 0)]),
    (3, [(0, 0), (0, 1), (1, 0)]),
    (4, [(0, 0), (0, 1), (1, 0), (1, 1)]),
    (6, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]),
    (100, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]),  # the prompts run out first
])
def test_plan_stops_at_the_limit(limit, samples):
    cursor = PromptCursor(None, "prod", prompts="three", group_size=2)
    jobs = Plan(three_prompts(), cursor, group_size=2, limit=limit).jobs(first=[])
    assert [(job.prompt, job.member) for job in jobs] == samples


def test_plan_job_past_the_last_prompt_is_none():
    cursor = PromptCursor(None, "prod", prompts="three", group_size=2)
    plan = Plan(three_prompts(), cursor, group_size=2, limit=0)
    assert plan.job((3, 0)) is None
    assert plan.job((7, 1)) is None
    job = plan.job((2, 1))
    assert job is not None and job.trajectory_id == f"{cursor.stem}-2-1" and job.group_id == f"{cursor.stem}-2"


def test_plan_after_a_restore_issues_the_outstanding_first_and_never_a_finished_one(tmp_path):
    first = kept(tmp_path)
    for sample in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        first.issued(sample)
    first.finished((0, 0))
    first.finished((1, 0))
    first.close()

    cursor = kept(tmp_path)
    assert cursor.outstanding == {(0, 1), (1, 1)} and cursor.next == (2, 0)
    s = cursor.stem
    jobs = list(Plan(three_prompts(), cursor, group_size=2, limit=0).jobs(first=[]))
    assert [job.trajectory_id for job in jobs] == [f"{s}-0-1", f"{s}-1-1", f"{s}-2-0", f"{s}-2-1"]
    assert s == first.stem
    cursor.close()


def test_plan_yields_the_outstanding_sorted(tmp_path):
    seven = Prompts(lambda p: (np.array([p], np.int32), None) if p < 7 else None, "seven")
    first = kept(tmp_path, prompts="seven", group_size=2)
    for sample in [(5, 1), (0, 1), (3, 0), (1, 1), (4, 0), (2, 1), (0, 0), (6, 0)]:
        first.issued(sample)
    first.finished((0, 0))
    first.finished((6, 0))
    first.close()
    cursor = kept(tmp_path, prompts="seven", group_size=2)
    assert cursor.next == (6, 1)
    jobs = Plan(seven, cursor, group_size=2, limit=0).jobs(first=[])
    assert [(job.prompt, job.member) for job in jobs] == [(0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (5, 1), (6, 1)]
    cursor.close()


def test_plan_yields_handed_back_jobs_first_and_not_again(tmp_path):
    first = kept(tmp_path)
    for sample in [(0, 0), (0, 1), (1, 0)]:
        first.issued(sample)
    first.close()
    cursor = kept(tmp_path)
    plan = Plan(three_prompts(), cursor, group_size=2, limit=0)
    handed_back = plan.job((1, 0))
    assert isinstance(handed_back, Job)
    jobs = plan.jobs(first=[handed_back])
    assert [(job.prompt, job.member) for job in jobs] == [(1, 0), (0, 0), (0, 1), (1, 1), (2, 0), (2, 1)]
    cursor.close()


def test_plan_after_a_restore_with_all_issued_yields_only_the_outstanding(tmp_path):
    first = kept(tmp_path)
    for prompt in range(3):
        for index in range(2):
            first.issued((prompt, index))
            if (prompt, index) != (1, 1):
                first.finished((prompt, index))
    first.close()
    cursor = kept(tmp_path)
    assert cursor.next == (3, 0)
    jobs = Plan(three_prompts(), cursor, group_size=2, limit=0).jobs(first=[])
    assert [(job.prompt, job.member) for job in jobs] == [(1, 1)]
    cursor.close()


def test_plan_with_a_limit_after_a_restore(tmp_path):
    recorded(tmp_path, issued=[(0, 0), (0, 1)], finished=[(0, 1)])
    cursor = kept(tmp_path)
    jobs = Plan(three_prompts(), cursor, group_size=2, limit=3).jobs(first=[])
    assert [(job.prompt, job.member) for job in jobs] == [(0, 0), (1, 0)]
    cursor.close()


# -- Prompts ---------------------------------------------------------------------

def test_prompts_from_a_file_skip_blank_lines(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input_ids": [5, 6, 7], "metadata": {"k": "v"}}\n\n   \n{"input_ids": [9]}\n', encoding="utf-8")
    prompts = Prompts.from_file(str(path))
    tokens, metadata = prompts.at(0)
    assert tokens.dtype == np.int32 and tokens.tolist() == [5, 6, 7]
    assert metadata == {"k": "v"}
    tokens, metadata = prompts.at(1)
    assert tokens.tolist() == [9] and metadata is None
    assert prompts.at(2) is None
    assert "prompts.jsonl" in prompts.identity


def test_prompts_from_a_file_refuse_a_line_without_input_ids(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input_ids": [1]}\n\n{"tokens": [2]}\n', encoding="utf-8")
    with pytest.raises(InvalidInput) as refused:
        Prompts.from_file(str(path))
    assert f"{path}:3:" in str(refused.value)
    assert "input_ids" in str(refused.value)


def test_prompts_from_a_file_refuse_a_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('[1, 2]\n', encoding="utf-8")
    with pytest.raises(InvalidInput, match=":1:"):
        Prompts.from_file(str(path))


def test_prompts_identity_follows_the_file_content(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input_ids": [1]}\n', encoding="utf-8")
    before = Prompts.from_file(str(path)).identity
    assert Prompts.from_file(str(path)).identity == before  # the same content: the same identity
    path.write_text('{"input_ids": [2]}\n', encoding="utf-8")
    assert Prompts.from_file(str(path)).identity != before


def test_a_cursor_refuses_a_changed_prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input_ids": [1]}\n', encoding="utf-8")
    spool = tmp_path / "spool"
    spool.mkdir()
    kept(spool, prompts=Prompts.from_file(str(path)).identity).close()
    path.write_text('{"input_ids": [1]}\n{"input_ids": [2]}\n', encoding="utf-8")
    with pytest.raises(CursorError):
        kept(spool, prompts=Prompts.from_file(str(path)).identity)


def test_drawn_prompts_are_the_same_for_the_same_seed_and_index():
    def draw(rng: np.random.Generator) -> np.ndarray:
        return rng.integers(0, 1_000_000, size=8, dtype=np.int32)

    one, two = Prompts.drawn(draw, 7, "eight tokens"), Prompts.drawn(draw, 7, "eight tokens")
    first, first_metadata = one.at(3)
    assert first_metadata is None
    assert np.array_equal(first, two.at(3)[0])
    assert np.array_equal(one.at(3)[0], first)  # asked again: the same
    assert not np.array_equal(first, one.at(4)[0])
    assert not np.array_equal(first, Prompts.drawn(draw, 8, "eight tokens").at(3)[0])
    assert one.identity == two.identity
    assert "7" in one.identity and "eight tokens" in one.identity
    assert Prompts.drawn(draw, 8, "eight tokens").identity != one.identity


@pytest.mark.parametrize("state, ours, on_restart, continues, action", [
    ("open", True, "continue", "prefix", "continue"),
    ("terminal", True, "continue", "again", "continue"),
    ("open", True, "continue", None, "restart"),  # a source that cannot continue restarts
    ("open", True, "restart", "prefix", "restart"),
    ("open", True, "abort", None, "abort"),
    ("open", False, "continue", "prefix", "abort"),  # not one of this run's prompts: nothing continues it
    ("scoring", True, "abort", None, "continue"),  # ended: only its reward can follow, whatever on_restart says
    ("scoring", False, "continue", "prefix", None),  # ended and not ours: left alone
])
def test_what_a_restart_does_with_a_trajectory_handed_back(state, ours, on_restart, continues, action):
    from rollstream.producer.resume import Resumable
    from rollstream.producer.source import _restart_action

    assert _restart_action(Resumable("t", 1, state), ours, on_restart, continues) == action
