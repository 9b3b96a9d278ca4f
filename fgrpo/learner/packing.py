"""How a step's sequences are laid out for the learner: rows packed with several sequences (first-fit
decreasing), a prompt shared by its group's samples, and micro-batches of at most so many token slots.

Pure index work on token lengths, no model: :func:`micro_batches` picks the layout with the least estimated work,
:func:`lay_out_rows` turns one micro-batch into token ids, positions and the prediction index (fgrpo.learner.forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Sequence:
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    old_logp: torch.Tensor | None = None  # [len(completion_ids)], set when mini_batches > 1
    # an episode's (fgrpo.rollout.episodes): 1 on the tokens the model sampled, 0 on the template's, observations' and
    # tools' tokens between its turns, which are in the forward (the context) but not in the loss; None: all 1
    loss_mask: list[int] | None = None
    sampler_logp: list[float] | None = None  # the sampler's log-prob of each completion token (algorithm.corrections)

    @property
    def loss_tokens(self) -> int:
        """The completion tokens the loss counts: the sampled ones."""
        return len(self.completion_ids) if self.loss_mask is None else int(sum(self.loss_mask))




@dataclass
class RowLayout:
    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W]
    predict_at: torch.Tensor  # [N]: flat index r * W + t of the hidden state that predicts each completion token
    allowed: torch.Tensor | None  # [R, 1, W, W] bool (query, key); None: transformers' packed mask from the positions
    real_tokens: int  # token slots holding prompt or completion tokens (a shared prompt counts once)
    # (query start, query length, prompt start, prompt length) in flat slots: each prompt copy (prompt length 0)
    # and each completion; what fgrpo.learner.segment_attention computes instead of the dense masked square
    segments: list[tuple[int, int, int, int]]
    # [R, W] each slot's unit (a prompt copy and its completions; each padding slot one of its own) and completion
    # (its index in seqs; -1: a prompt): what fgrpo.learner.flex_attention builds its block mask from
    unit_of: torch.Tensor | None = None
    completion_of: torch.Tensor | None = None


def lay_out_rows(
    seqs: list[Sequence], rows: list[list[int]], pad_id: int, device, *, share_prompts: bool = False,
    dense_mask: bool = True, width_multiple: int = 1,
) -> RowLayout:
    """Token ids, positions and the prediction index for ``seqs`` laid out in ``rows`` (indices into ``seqs``).

    Each row holds its sequences one after the other, then padding; positions restart at 0 for each
    sequence and for the padding, so transformers' packed-sequence mask keeps them apart. With
    ``share_prompts``, a run of consecutive sequences in a row with the same prompt is laid out as
    the prompt once and then each completion, positions continuing from the prompt's end: every
    completion attends to the prompt and to itself only (the ``allowed`` mask), which gives each
    completion the log-probs of its own unshared sequence while the prompt is computed once.
    ``predict_at`` lists, sequence by sequence in ``seqs``' order, where each completion token is
    predicted from: the prompt's last token for the first, then the completion's own tokens.
    ``dense_mask=False`` leaves ``allowed`` out (segment and flex attention read ``segments`` or the slot labels
    instead). ``width_multiple``: rows padded to a multiple of it (flex attention's tile).
    """
    if any(not seqs[i].prompt_ids for row in rows for i in row):  # a first completion token needs a predictor
        raise ValueError("a sequence needs at least one prompt token (e.g. BOS)")
    units = [prompt_units(seqs, row, share_prompts) for row in rows]
    fills = [units_length(seqs, row_units) for row_units in units]
    width = -(-max(fills) // width_multiple) * width_multiple
    shared = any(len(u) > 1 for row_units in units for u in row_units)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    # for the mask: which unit (prompt + its completions) a slot is in, and which completion (-1: the prompt);
    # each padding slot is a unit of its own, so it attends to itself only
    unit_of = torch.arange(len(rows) * width).view(len(rows), width)
    completion_of = torch.full((len(rows), width), -1, dtype=torch.long)
    predict_at: list[torch.Tensor | None] = [None] * len(seqs)
    segments: list[tuple[int, int, int, int]] = []
    for r, row_units in enumerate(units):
        start = 0
        for unit in row_units:
            prompt = seqs[unit[0]].prompt_ids
            unit_start = start
            input_ids[r, start : start + len(prompt)] = torch.tensor(prompt)
            position_ids[r, start : start + len(prompt)] = torch.arange(len(prompt))
            segments.append((r * width + start, len(prompt), 0, 0))
            start += len(prompt)
            for i in unit:
                completion = seqs[i].completion_ids
                input_ids[r, start : start + len(completion)] = torch.tensor(completion, dtype=torch.long)
                position_ids[r, start : start + len(completion)] = torch.arange(len(prompt), len(prompt) + len(completion))
                completion_of[r, start : start + len(completion)] = i
                segments.append((r * width + start, len(completion), r * width + unit_start, len(prompt)))
                # the hidden state at t predicts the token after t: the prompt's last token predicts the first
                # completion token, completion token j - 1 predicts token j
                flat = r * width
                predict_at[i] = torch.cat([torch.tensor([flat + unit_start + len(prompt) - 1]),
                                           torch.arange(flat + start, flat + start + len(completion) - 1)])[: len(completion)]
                start += len(completion)
            unit_of[r, unit_start:start] = unit_of[r, unit_start]
        position_ids[r, start:] = torch.arange(width - start)
    allowed = None
    if shared and dense_mask:  # segment attention needs only the segments
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same_unit = unit_of[:, :, None] == unit_of[:, None, :]
        key_visible = (completion_of[:, None, :] == -1) | (completion_of[:, None, :] == completion_of[:, :, None])
        allowed = (causal & same_unit & key_visible)[:, None].to(device)
    return RowLayout(input_ids.to(device), position_ids.to(device), torch.cat(predict_at).to(device), allowed,
                     sum(fills), segments, unit_of, completion_of)


def prompt_units(seqs: list[Sequence], row: list[int], share_prompts: bool) -> list[list[int]]:
    """A row's sequences as laid out behind one copy of their prompt: runs of consecutive same-prompt
    sequences when ``share_prompts``, else one sequence each."""
    units: list[list[int]] = []
    for i in row:
        if share_prompts and units and seqs[units[-1][0]].prompt_ids == seqs[i].prompt_ids:
            units[-1].append(i)
        else:
            units.append([i])
    return units


def units_length(seqs: list[Sequence], units: list[list[int]]) -> int:
    """Token slots the units take: each prompt once, then its completions."""
    return sum(len(seqs[u[0]].prompt_ids) + sum(len(seqs[i].completion_ids) for i in u) for u in units)


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` grouped into rows of at most ``width`` tokens each.

    A length over ``width`` gets a row of its own. Deterministic; rows in order of their first (longest) item.
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


@dataclass
class MicroBatch:
    seqs: list[Sequence]
    rows: list[list[int]] | None  # packed rows (indices into seqs); None: one padded sequence per row
    padded_tokens: int  # rows x width: what the forward and backward compute over
    real_tokens: int  # of those, the slots holding tokens (a shared prompt counts once)
    share_prompts: bool = False  # runs of same-prompt sequences in a row share one copy of the prompt


def micro_batches(
    seqs: list[Sequence], *, size: int, tokens: int | None = None, width_cost: float = 0.0,
    share_prompts: bool = False, one_row: bool = False, row_multiple: int = 1,
) -> list[MicroBatch]:
    """Split a step's sequences for gradient accumulation.

    ``tokens`` set: each micro-batch holds at most ``tokens`` token slots (rows x its widest row; a
    row longer than that gets a micro-batch of its own). Several layouts are tried and the one with
    the least estimated work kept: one sequence per row, sorted by length (best when lengths are
    even), and sequences packed several to a row (:func:`pack_rows`) in rows 1, 1.5 or 2 times as
    wide as the longest sequence (wider rows pack better, as RL completions of mixed lengths need).
    ``share_prompts`` adds layouts where the samples of one prompt (all of them, or split in 2 or 4
    parts) follow one copy of it: a group's G samples then cost one prompt instead of G.
    The work of a micro-batch is ``slots * (1 + width * width_cost)``: attention over a row costs in
    proportion to its width (:func:`attention_width_cost`). None: ``size`` sequences per
    micro-batch, sorted by length, one per row.
    ``one_row`` (with ``tokens``; for segment attention, where a row's width costs nothing): each
    micro-batch is one row without padding; sequences, or groups whole or in parts, are packed into
    micro-batches by the tokens they hold, and the choice with the fewest slots (then micro-batches) is kept. The
    batch dimension is then always 1, which torch.compile would otherwise recompile for when it first
    turns up. ``row_multiple``: each such row is padded to a multiple of it (flex attention's tile), counted in
    ``padded_tokens``.
    """
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    if tokens is None:
        order = sorted(range(len(seqs)), key=lambda i: lengths[i])
        chunks = [order[i : i + size] for i in range(0, len(order), size)]
        return [MicroBatch([seqs[i] for i in chunk], None, len(chunk) * max(lengths[i] for i in chunk),
                           sum(lengths[i] for i in chunk)) for chunk in chunks]

    def widths(longest: int) -> list[int]:  # wider rows only while one still fits the budget
        return sorted({min(int(longest * scale), max(tokens, longest)) for scale in (1, 1.5, 2)})

    # the pieces a layout is made of: (units of sequence indices, the tokens each unit holds, whether the
    # unit's sequences share their prompt): single sequences, and with share_prompts each group whole or in 2 or 4 parts
    pieces = [([[i] for i in range(len(seqs))], lengths, False)]
    if share_prompts:
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, seq in enumerate(seqs):
            groups.setdefault(tuple(seq.prompt_ids), []).append(i)
        for parts in (1, 2, 4):
            units = [group[k::parts] for group in groups.values() for k in range(min(parts, len(group)))]
            pieces.append((units, [units_length(seqs, [u]) for u in units], True))
    if one_row:
        return _one_row_micro_batches(seqs, pieces, tokens, row_multiple)
    # candidate layouts: (rows of sequence indices, the tokens each row holds, whether prompts are shared)
    layouts = [pieces[0]]
    for units, unit_lengths, shared in pieces:
        for width in widths(max(unit_lengths)):
            rows = [[i for u in row for i in units[u]] for row in pack_rows(unit_lengths, width)]
            if shared:  # a row's units sorted by prompt, so parts of one group that share a row share one prompt copy
                rows = [sorted(row, key=lambda i: (seqs[i].prompt_ids, i)) for row in rows]
            layouts.append((rows, [units_length(seqs, prompt_units(seqs, row, shared)) for row in rows], shared))
    best, best_shared, best_work = [], False, math.inf
    for rows, fills, shared in layouts:
        batches = _fill_micro_batches(rows, fills, tokens)
        work = sum(slots * (1 + width * width_cost) for _, slots, width, _ in batches)
        if work < best_work:
            best, best_shared, best_work = batches, shared, work
    out = []
    for group, slots, _, real in best:
        order = [i for row in group for i in row]
        local = {i: j for j, i in enumerate(order)}
        out.append(MicroBatch([seqs[i] for i in order], [[local[i] for i in row] for row in group], slots, real,
                              best_shared))
    return out


def _one_row_micro_batches(
    seqs: list[Sequence], pieces: list[tuple[list[list[int]], list[int], bool]], tokens: int, row_multiple: int = 1,
) -> list[MicroBatch]:
    """Each candidate's units packed into micro-batches of at most ``tokens`` slots, each laid out as one row; the
    candidate with the fewest slots in all, then the fewest micro-batches. A unit over ``tokens`` goes alone."""
    best: list[tuple[list[int], int]] = []
    best_shared, best_key = False, (math.inf, math.inf)
    for units, unit_lengths, shared in pieces:
        batches = []
        for packed in pack_rows(unit_lengths, tokens):
            order = [i for u in packed for i in units[u]]
            if shared:  # parts of one group side by side, so that they share one prompt copy
                order.sort(key=lambda i: (seqs[i].prompt_ids, i))
            batches.append((order, units_length(seqs, prompt_units(seqs, order, shared))))
        key = (sum(slots for _, slots in batches), len(batches))
        if key < best_key:
            best, best_shared, best_key = batches, shared, key
    return [MicroBatch([seqs[i] for i in order], [list(range(len(order)))], -(-slots // row_multiple) * row_multiple,
                       slots, best_shared) for order, slots in best]



def _fill_micro_batches(
    rows: list[list[int]], fills: list[int], tokens: int
) -> list[tuple[list[list[int]], int, int, int]]:
    """Rows, widest first, into micro-batches of at most ``tokens`` slots: ``[(rows, slots, width, filled slots)]``.

    ``fills[r]``: the tokens row ``r`` holds.
    """
    groups: list[list] = []  # [rows, width (the first, widest, row's fill), filled slots]
    for r in sorted(range(len(rows)), key=lambda r: -fills[r]):
        if groups and (len(groups[-1][0]) + 1) * groups[-1][1] <= tokens:
            groups[-1][0].append(rows[r])
            groups[-1][2] += fills[r]
        else:
            groups.append([[rows[r]], fills[r], fills[r]])
    return [(group, len(group) * width, width, filled) for group, width, filled in groups]
