"""A GradScaler's device-side state in one float32 buffer, with a log of the updates since a fold.

On a GPU each op is a kernel launch, so a device-side update must be a handful of ops, not one per
field. The scale, the trackers and the event counters live in one buffer of 4-byte words; an
update runs the scale rule and writes one row ``[found_inf, scale, growth_tracker]`` to a log in
the same buffer; the counters are derived from the log only when someone asks (a fold): steps and
skipped steps count the rows and their flags, growths and back-offs the rises (on clean rows) and
falls of the scale from row to row, skipped-in-a-row the run of flagged rows at the end.
Publishing the whole state for a metrics scrape is then one copy of the buffer.

Layout (word index: meaning):
    0: scale (float32)
    1: growth tracker (int32)
    2: hysteresis tracker (int32); with hysteresis 1 the rule leaves it to the fold
    3: the scale at the last fold (float32): the first row's rise or fall is against it
    4-13: the five counters (int64, ``_policy.COUNTER_NAMES``) as of the last fold
    14-: LOG_ROWS rows of three words
A full log is folded on the device (about 25 small ops, once every LOG_ROWS updates).
"""

from __future__ import annotations

import struct

import torch

from dscale.scaler._program.scale_rule import NUM_COUNTERS, HostState, ScalePolicy

SCALE, GROWTH, HYSTERESIS, FOLD_SCALE, COUNTERS = 0, 1, 2, 3, 4
LOG = COUNTERS + 2 * NUM_COUNTERS
ROW = 3  # found_inf, scale, growth tracker (its int32 bits)
LOG_ROWS = 64
WORDS = LOG + ROW * LOG_ROWS
_HEADER = struct.Struct(f"<fiif{NUM_COUNTERS}q")


def header_words(host: HostState) -> torch.Tensor:
    """The buffer's first LOG words for ``host`` (an empty log), as a CPU tensor."""
    packed = _HEADER.pack(
        host.scale, host.growth_tracker, host.hysteresis_tracker, host.scale, *host.counters
    )
    return torch.frombuffer(bytearray(packed), dtype=torch.float32)


def write_header_traced(words: torch.Tensor, host: HostState) -> None:
    """:func:`header_words` written into ``words`` by tensor ops (struct does not trace)."""
    # Each part made as its own dtype and viewed as float32 words (the buffer's own dtype:
    # AOTAutograd refuses some mutations through a view of another dtype).
    parts = [
        torch.tensor([host.scale], dtype=torch.float32),
        torch.tensor([host.growth_tracker, host.hysteresis_tracker], dtype=torch.int32),
        torch.tensor([host.scale], dtype=torch.float32),
        torch.tensor(host.counters, dtype=torch.int64),
    ]
    header = torch.cat([part.view(torch.float32) for part in parts])
    words[:LOG].copy_(header.to(words.device))


def int32_at(words: torch.Tensor, index: int) -> torch.Tensor:
    """A 0-d int32 view of one word."""
    return words[index : index + 1].view(torch.int32).view(())


def counters_view(words: torch.Tensor) -> torch.Tensor:
    """The int64 counters as of the last fold, a view."""
    return words[COUNTERS:LOG].view(torch.int64)


def row_view(words: torch.Tensor, row: int) -> torch.Tensor:
    return words[LOG + ROW * row : LOG + ROW * (row + 1)]


def log_rule_hysteresis(policy: ScalePolicy) -> bool:
    """Whether the fold derives the hysteresis tracker (the update leaves it: hysteresis 1)."""
    return policy.hysteresis == 1


def fold_on_host(words: torch.Tensor, rows: int, policy: ScalePolicy | None) -> HostState:
    """The state in a CPU copy of the buffer with ``rows`` logged updates, as Python numbers.

    ``policy`` is the rule the rows ran under (None only when no row was logged).
    """
    raw = words.numpy().tobytes()
    scale, tracker, hyst, prev, *counters = _HEADER.unpack_from(raw)
    steps, skipped, in_a_row, growths, backoffs = counters
    logged = memoryview(raw)[LOG * 4 : (LOG + ROW * rows) * 4]
    refill_any = policy is not None and policy.hysteresis_refill == "on_clean_step"
    derive = policy is not None and log_rule_hysteresis(policy)
    for found, row_scale, row_tracker in struct.iter_unpack("<ffi", logged):
        steps += 1
        if found > 0:
            skipped += 1
            in_a_row += 1
        else:
            in_a_row = 0
        growths += row_scale > prev and not found > 0  # an overflow never grows the scale
        backoffs += row_scale < prev
        prev = row_scale
        if derive:
            if found > 0:
                hyst = 0
            elif refill_any or row_tracker == 0:
                hyst = 1  # hysteresis 1: the only rule whose tracker the fold derives
    return HostState(scale, tracker, hyst, (steps, skipped, in_a_row, growths, backoffs))


def fold_on_device(words: torch.Tensor, rows: int, policy: ScalePolicy) -> None:
    """Fold ``rows`` logged updates into the counters (and hysteresis) in place; empties the log."""
    if rows == 0:
        return
    log = words[LOG : LOG + ROW * rows].view(rows, ROW)
    found = log[:, 0] > 0
    scales = log[:, 1]
    previous = torch.cat([words[FOLD_SCALE : FOLD_SCALE + 1], scales[:-1]])
    index = torch.arange(rows, device=words.device)
    none = torch.full_like(index, -1)
    last_clean = torch.where(found, none, index).amax()
    counters = counters_view(words)
    in_a_row = torch.where(last_clean < 0, counters[2] + rows, rows - 1 - last_clean)
    increments = torch.stack(
        [
            torch.full_like(last_clean, rows),
            found.sum(),
            in_a_row - counters[2],
            ((scales > previous) & ~found).sum(),  # a rise on an overflow: min_scale's clamp
            (scales < previous).sum(),
        ]
    )
    counters.add_(increments)
    if log_rule_hysteresis(policy):
        refill = ~found
        if policy.hysteresis_refill != "on_clean_step":
            refill &= log[:, 2].view(torch.int32) == 0
        last_found = torch.where(found, index, none).amax()
        last_refill = torch.where(refill, index, none).amax()
        hyst = int32_at(words, HYSTERESIS)
        refilled = torch.where(last_refill > last_found, policy.hysteresis, hyst)
        hyst.copy_(torch.where(last_found > last_refill, 0, refilled))
    words[FOLD_SCALE].copy_(words[SCALE])


def fold_row_on_device(
    words: torch.Tensor,
    policy: ScalePolicy,
    found_inf: torch.Tensor,
    before: torch.Tensor,
    tracker: torch.Tensor,
) -> None:
    """One update folded into the counters at once (compiled updates: no log row).

    The same counts as :func:`fold_on_device` over a log of that one row: ``found_inf`` the
    update's flag, ``before`` the scale before it, ``tracker`` the growth tracker after it.
    """
    found = found_inf > 0
    scale = words[SCALE]
    counters = counters_view(words)
    in_a_row = torch.where(found, counters[2] + 1, 0)
    increments = torch.stack(
        [
            torch.ones_like(in_a_row),
            found.long(),
            in_a_row - counters[2],
            ((scale > before) & ~found).long(),
            (scale < before).long(),
        ]
    )
    counters.add_(increments)
    if log_rule_hysteresis(policy):
        refill = ~found
        if policy.hysteresis_refill != "on_clean_step":
            refill &= tracker == 0
        hyst = int32_at(words, HYSTERESIS)
        hyst.copy_(torch.where(found, 0, torch.where(refill, policy.hysteresis, hyst)))
    words[FOLD_SCALE].copy_(scale)
