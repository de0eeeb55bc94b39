"""Read per-rank communication traces into one shape: our recorder's jsonl and PyTorch profiler JSON.

Two sources, one result (``TraceSet``: a list of ``CommEvent`` per global rank):

* ``rank{R}.jsonl`` written by ``l3plugin.debug.record_collectives`` (format in ``recorder.py``).
  Strict: the first line is the metadata record, the last one the end record; a file without its end
  record is truncated (the process died or the context never exited) and is refused.
* PyTorch profiler (Kineto) chrome traces, ``*.json`` or ``*.json.gz`` (``prof.export_chrome_trace``).
  Fields read, and nothing else:
    - top level: ``traceEvents`` (or the file is a bare event list), ``baseTimeNanoseconds`` (newer
      Kineto writes ``ts`` relative to it; we add it back so ranks share one clock),
      ``distributedInfo.rank`` / ``.world_size`` (else the rank comes from a ``rank<N>`` file name).
    - events with ``ph == "X"`` whose ``args`` carry ``"Collective name"`` and ``"Process Group Ranks"``:
      the NCCL kernels (``cat == "kernel"``, GPU time: when the GPU reached the collective) and, only
      when a file has no such kernel, the ``record_param_comms`` CPU ops (CPU issue time).
    - from those: ``ts``/``dur`` (microseconds), ``Collective name``, ``Process Group Name``,
      ``Process Group Ranks`` (a list or the string "[0, 1, 2]"; Kineto truncates past 30 ranks to
      "[r0, ..., r28, ..., rN]", which we rebuild from ``Global rank start``/``Global rank stride`` or
      from an arithmetic progression with ``Group size`` members, and refuse otherwise), ``Group size``,
      ``Src Rank``/``Dst Rank`` (global peer of recv/send), ``Seq`` (the group's collective sequence
      number, used for collectives when present), ``In msg nelems``/``Out msg nelems``/``dtype``.
  NCCL's coalesced P2P batches (``batch_isend_irecv``: "Collective name" "coalesced", no peer ranks)
  cannot be paired with their peers and are left out (counted in the warnings).
  On CPU with gloo the profiler records ``c10d::*`` ops and ``gloo:*`` annotations *without* any process
  group information, so such a trace cannot be analysed: the reader says so instead of guessing.

Every malformed input raises ``ValueError`` naming the file and the line (jsonl, JSON syntax) or the
event index (semantic errors in a chrome trace).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass, field

RECORDER_FORMAT = "l3plugin-collectives"
RECORDER_VERSION = 1
P2P_OPS = ("send", "recv")

# Kineto "dtype" strings (c10::toString(ScalarType)) -> bytes per element.
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Int": 4, "Long": 8, "Short": 2,
                "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}


@dataclass(frozen=True)
class CommEvent:
    """One collective or P2P call as one rank saw it. Times are microseconds on a clock shared by ranks."""

    rank: int
    op: str                    # canonical name: all_reduce, all_gather, reduce_scatter, send, recv, ...
    group: tuple[int, ...]     # sorted global ranks of the process group it ran on
    pg: str                    # process group name ("" if unknown): two groups may share members
    seq: int                   # per-channel sequence number: the n-th call on this channel
    start_us: float
    end_us: float | None       # None when the completion was not observed
    nbytes: int | None = None
    src: int | None = None     # P2P only: global ranks of sender and receiver
    dst: int | None = None
    tag: int = 0

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P_OPS

    @property
    def participants(self) -> tuple[int, ...]:
        """The ranks that must all arrive before this call can finish."""
        return tuple(sorted((self.src, self.dst))) if self.is_p2p else self.group

    @property
    def channel(self) -> tuple:
        """Calls on one channel are matched across ranks by their order (``seq``) on it."""
        if self.is_p2p:
            return ("p2p", self.pg, self.src, self.dst, self.tag)
        return ("coll", self.pg, self.group)

    @property
    def duration_us(self) -> float | None:
        return None if self.end_us is None else self.end_us - self.start_us


@dataclass
class TraceSet:
    events: dict[int, list[CommEvent]]
    world_size: int
    source: str                                    # "recorder" or "kineto"
    files: dict[int, str]
    mesh_sizes: dict[str, int] | None = None       # {"tp":..,"cp":..,"pp":..,"dp":..} from metadata
    recorded_groups: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def canonical_op(name: str) -> str:
    """Backend-specific names ("_allgather_base", "allreduce", "reduce_scatter_tensor") -> one name."""
    n = name.lower().strip().strip('"').replace("nccl:", "").replace("gloo:", "").replace("c10d::", "")
    flat = n.replace("_", "")
    for key, canon in (("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
                       ("allgather", "all_gather"), ("alltoall", "all_to_all"), ("broadcast", "broadcast"),
                       ("barrier", "barrier"), ("send", "send"), ("recv", "recv"), ("gather", "gather"),
                       ("scatter", "scatter"), ("reduce", "reduce")):
        if key in flat:
            return canon
    return n


def _rank_from_filename(path: str) -> int | None:
    m = re.search(r"rank[_-]?(\d+)", os.path.basename(path))
    return int(m.group(1)) if m else None


# --- our recorder's jsonl -------------------------------------------------------------------------

def _need(obj: dict, key: str, types, where: str, allow_none: bool = False):
    if key not in obj:
        raise ValueError(f"{where}: missing field {key!r}")
    value = obj[key]
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        raise ValueError(f"{where}: field {key!r} = {value!r} has the wrong type "
                         f"(expected {getattr(types, '__name__', types)})")
    return value


def _int_list(obj, key, where) -> list[int]:
    value = _need(obj, key, list, where)
    if not value or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"{where}: field {key!r} = {value!r} must be a non-empty list of ranks")
    return value


def _text_lines(path: str) -> list[str]:
    """The lines of a text trace (newlines kept), or a ValueError naming the file (and line) that is not."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:  # e.g. a directory named rank0.jsonl, or no permission
        raise ValueError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}:{lineno}: byte {exc.start} is not UTF-8 text: a binary or corrupted file, "
                         f"not a record_collectives trace") from None
    lines = text.split("\n")  # records end with "\n" only (str.splitlines would also cut at \r, \x1c, ...)
    tail = lines.pop()
    return [line + "\n" for line in lines] + ([tail] if tail else [])


def read_recorder_trace(path: str, expected_rank: int | None = None):
    """Parse one ``rank{R}.jsonl``: returns (metadata dict, [CommEvent], notes).

    A receive from any source whose sender was never learned (an ``irecv`` without ``src``) cannot be
    matched with its send; it is left out and counted in the notes.
    """
    meta, events, end, dropped = None, [], None, 0
    seen = set()
    for lineno, line in enumerate(_text_lines(path), start=1):
        where = f"{path}:{lineno}"
        if end is not None:
            raise ValueError(f"{where}: data after the end record; the file was appended to or corrupted")
        if not line.endswith("\n"):
            raise ValueError(f"{where}: last line is cut off (no newline): the trace is truncated")
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg}); the file is truncated or corrupted") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        kind = rec.get("kind")
        if lineno == 1:
            if kind != "meta" or rec.get("format") != RECORDER_FORMAT:
                raise ValueError(f"{where}: first line must be the {RECORDER_FORMAT} metadata record; "
                                 f"this is not a record_collectives trace")
            if rec.get("version") != RECORDER_VERSION:
                raise ValueError(f"{where}: trace format version {rec.get('version')!r} is not supported "
                                 f"(this reader knows version {RECORDER_VERSION})")
            if _need(rec, "rank", int, where) != expected_rank and expected_rank is not None:
                raise ValueError(f"{where}: metadata says rank {rec['rank']} but the file name says "
                                 f"rank {expected_rank}")
            _need(rec, "world_size", int, where)
            _check_mesh(rec, where)
            meta = rec
        elif kind == "op":
            ev = _op_record(rec, meta["rank"], where, seen)
            if ev is None:
                dropped += 1
            else:
                events.append(ev)
        elif kind == "end":
            end = rec
            if _need(rec, "records", int, where) != len(events) + dropped:
                raise ValueError(f"{where}: end record counts {rec['records']} calls but the file holds "
                                 f"{len(events) + dropped}: records are missing")
            _check_mesh(rec, where)
            for key in ("mesh", "groups"):  # learned only at exit (parallel_state set up inside)
                if meta.get(key) is None and rec.get(key) is not None:
                    meta[key] = rec[key]
        else:
            raise ValueError(f"{where}: unknown record kind {kind!r}")
    if meta is None:
        raise ValueError(f"{path}: empty file: not a record_collectives trace")
    if end is None:
        raise ValueError(f"{path}: no end record after line {lineno}: the trace is truncated "
                         f"(the process died or record_collectives did not exit)")
    notes = [f"{path}: {dropped} receive(s) from an unknown source left out"] if dropped else []
    return meta, events, notes


def _check_mesh(rec: dict, where: str):
    if rec.get("mesh") is not None:
        if not isinstance(rec["mesh"], dict):
            raise ValueError(f"{where}: field 'mesh' must be an object with tp, cp, pp, dp")
        for dim in ("tp", "cp", "pp", "dp"):
            _need(rec["mesh"], dim, int, where + " (mesh)")
    if rec.get("groups") is not None and not isinstance(rec["groups"], dict):
        raise ValueError(f"{where}: field 'groups' must be an object of rank lists")


def _op_record(rec: dict, rank: int, where: str, seen: set) -> CommEvent | None:
    op = canonical_op(_need(rec, "op", str, where))
    group = tuple(sorted(_int_list(rec, "group", where)))
    start = _need(rec, "start", int, where)
    end = _need(rec, "end", int, where, allow_none=True)
    if end is not None and end < start:
        raise ValueError(f"{where}: end {end} is before start {start}")
    src = dst = None
    if op in P2P_OPS:
        src = _need(rec, "src", int, where, allow_none=(op == "recv"))
        dst = _need(rec, "dst", int, where)
        mine = src if op == "send" else dst
        if mine is not None and mine != rank:
            raise ValueError(f"{where}: a {op} recorded by rank {rank} names rank {mine} as its own end")
    unknown_sender = op == "recv" and src is None
    seq = _need(rec, "seq", int, where, allow_none=unknown_sender)
    if unknown_sender:
        return None
    ev = CommEvent(rank=rank, op=op, group=group, pg=str(rec.get("pg") or ""), seq=seq,
                   start_us=start / 1000.0, end_us=None if end is None else end / 1000.0,
                   nbytes=_need(rec, "bytes", int, where), src=src, dst=dst, tag=int(rec.get("tag") or 0))
    if (ev.channel, seq) in seen:
        raise ValueError(f"{where}: sequence number {seq} appears twice on channel {ev.channel}")
    seen.add((ev.channel, seq))
    if rank not in ev.participants:
        raise ValueError(f"{where}: rank {rank} recorded a call on group {list(group)} it is not part of")
    return ev


# --- PyTorch profiler chrome traces ---------------------------------------------------------------

def parse_group_ranks(value, group_size=None, start=None, stride=None, where="") -> tuple[int, ...]:
    """"Process Group Ranks" as Kineto writes it (list, "[0, 1]" or truncated "[0, 1, ..., 63]")."""
    if isinstance(value, list):
        items = value
    elif isinstance(value, str):
        text = value.strip().strip('"').strip()
        if not (text.startswith("[") and text.endswith("]")):
            raise ValueError(f"{where}: 'Process Group Ranks' = {value!r} is not a list")
        items = [t.strip() for t in text[1:-1].split(",") if t.strip()]
    else:
        raise ValueError(f"{where}: 'Process Group Ranks' = {value!r} is not a list")
    if "..." not in items:
        try:
            ranks = [int(t) for t in items]
        except (TypeError, ValueError):
            raise ValueError(f"{where}: 'Process Group Ranks' = {value!r} holds non-integers") from None
        if group_size is not None and len(ranks) != int(group_size):
            raise ValueError(f"{where}: 'Process Group Ranks' lists {len(ranks)} ranks but 'Group size' "
                             f"is {group_size}")
        return tuple(sorted(ranks))
    # Truncated: the head, "...", then the last rank. Rebuild it only when that is unambiguous.
    try:
        head = [int(t) for t in items[:items.index("...")]]
        last = int(items[-1])
    except ValueError:
        raise ValueError(f"{where}: cannot parse truncated 'Process Group Ranks' {value!r}") from None
    if group_size is None:
        raise ValueError(f"{where}: 'Process Group Ranks' {value!r} is truncated and no 'Group size' is given")
    size = int(group_size)
    if start is not None and stride is not None:
        ranks = list(range(int(start), int(start) + int(stride) * size, int(stride)))
    elif len(head) >= 2:
        step = head[1] - head[0]
        ranks = list(range(head[0], head[0] + step * size, step)) if step > 0 else []
    else:
        ranks = []
    if len(ranks) != size or ranks[:len(head)] != head or ranks[-1] != last:
        raise ValueError(f"{where}: 'Process Group Ranks' {value!r} is truncated and is not an evenly "
                         f"strided group of {size} ranks; cannot rebuild its members")
    return tuple(ranks)


def _load_json(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                         f"the trace is truncated or corrupted") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the trace ({exc})") from None


def read_kineto_trace(path: str):
    """Parse one profiler chrome trace: returns (rank, world_size or None, [CommEvent], notes)."""
    data = _load_json(path)
    if isinstance(data, dict):
        if not isinstance(data.get("traceEvents"), list):
            raise ValueError(f"{path}: no 'traceEvents' list: not a chrome trace")
        raw, base_ns = data["traceEvents"], data.get("baseTimeNanoseconds") or 0
        dist_info = data.get("distributedInfo") if isinstance(data.get("distributedInfo"), dict) else {}
    elif isinstance(data, list):
        raw, base_ns, dist_info = data, 0, {}
    else:
        raise ValueError(f"{path}: top level is {type(data).__name__}: not a chrome trace")
    rank = dist_info.get("rank")
    rank = int(rank) if isinstance(rank, (int, str)) and str(rank).isdigit() else _rank_from_filename(path)
    if rank is None:
        raise ValueError(f"{path}: cannot tell which rank wrote it: no distributedInfo.rank and no "
                         f"'rank<N>' in the file name")
    world = dist_info.get("world_size")
    world = int(world) if isinstance(world, (int, str)) and str(world).isdigit() else None

    comm = [(i, e) for i, e in enumerate(raw) if isinstance(e, dict) and e.get("ph") == "X"
            and isinstance(e.get("args"), dict) and "Collective name" in e["args"]]
    kernels = [(i, e) for i, e in comm if e.get("cat") == "kernel"]
    chosen = kernels or [(i, e) for i, e in comm if e.get("name") == "record_param_comms"]
    if not chosen:
        unlabeled = sum(1 for e in raw if isinstance(e, dict) and str(e.get("name", "")).startswith(
            ("c10d::", "gloo:", "nccl:")))
        raise ValueError(
            f"{path}: no collective event carries process-group info ('Collective name' and "
            f"'Process Group Ranks' args on NCCL kernels or record_param_comms ops); found {unlabeled} "
            f"c10d::/gloo: events without it. PyTorch's CPU profiler does not attach group info to gloo "
            f"collectives: record them with l3plugin.debug.record_collectives instead")
    events, counters, coalesced = [], {}, 0
    for index, ev in sorted(chosen, key=lambda ie: float(ie[1].get("ts", 0) or 0)):
        if canonical_op(str(ev["args"]["Collective name"])) == "coalesced":
            coalesced += 1
            continue
        events.append(_kineto_event(ev, index, rank, base_ns, path, counters))
    notes = [f"{path}: {coalesced} coalesced P2P batches without peer ranks left out"] if coalesced else []
    return rank, world, events, notes


def _kineto_event(ev: dict, index: int, rank: int, base_ns, path: str, counters: dict) -> CommEvent:
    where = f"{path}: event #{index} ({ev.get('name', '?')!s:.60})"
    args = ev["args"]
    try:
        start = float(ev["ts"]) + float(base_ns) / 1000.0
        dur = float(ev.get("dur", 0.0))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{where}: missing or non-numeric 'ts'/'dur'") from None
    if dur < 0:
        raise ValueError(f"{where}: negative duration {dur}")
    if "Process Group Ranks" not in args:
        raise ValueError(f"{where}: collective without 'Process Group Ranks'; cannot tell its group")
    group = parse_group_ranks(args["Process Group Ranks"], args.get("Group size"), args.get("Global rank start"),
                              args.get("Global rank stride"), where)
    op = canonical_op(str(args["Collective name"]))
    src = dst = None
    if op in P2P_OPS:
        peer_key = "Dst Rank" if op == "send" else "Src Rank"
        if peer_key not in args:
            raise ValueError(f"{where}: {op} without {peer_key!r}; cannot match it with its peer")
        peer = int(args[peer_key])
        src, dst = (rank, peer) if op == "send" else (peer, rank)
    elif rank not in group:
        raise ValueError(f"{where}: rank {rank} is not in the event's group {list(group)}")
    pg = str(args.get("Process Group Name", "")).strip('"')
    nbytes = None
    elem = _DTYPE_BYTES.get(str(args.get("dtype", "")).strip('"'))
    try:
        if elem:
            nbytes = elem * max(int(args.get("In msg nelems", 0)), int(args.get("Out msg nelems", 0)))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: non-integer message size") from None
    proto = CommEvent(rank, op, group, pg, 0, start, start + dur, nbytes, src, dst)
    # The group's "Seq" is the same on every member for collectives; P2P counters are per group, not
    # per pair, so P2P calls are numbered by their order on the (sender, receiver) channel instead.
    seq = args.get("Seq")
    if op in P2P_OPS or not isinstance(seq, int) or isinstance(seq, bool):
        seq = counters.get(proto.channel, 0)
        counters[proto.channel] = seq + 1
    return CommEvent(rank, op, group, pg, seq, start, start + dur, nbytes, src, dst)


# --- a directory of traces ------------------------------------------------------------------------

def _list_traces(trace_dir: str, kind: str):
    if not os.path.isdir(trace_dir):
        raise ValueError(f"{trace_dir}: not a directory of per-rank traces")
    names = sorted(os.listdir(trace_dir))
    jsonl = [n for n in names if re.fullmatch(r"rank\d+\.jsonl", n)]
    chrome = [n for n in names if n.endswith((".json", ".json.gz"))]
    if kind == "auto":
        kind = "recorder" if jsonl else "kineto"
    if kind not in ("recorder", "kineto"):
        raise ValueError(f"unknown trace kind {kind!r}: use auto, recorder or kineto")
    files = jsonl if kind == "recorder" else chrome
    for name in files:
        if os.path.isdir(os.path.join(trace_dir, name)):
            raise ValueError(f"{os.path.join(trace_dir, name)}: is a directory, not a trace file; move it out "
                             f"of {trace_dir}")
    if not files:
        raise ValueError(f"{trace_dir}: no trace files (expected rank<R>.jsonl from record_collectives or "
                         f"profiler *.json / *.json.gz chrome traces)")
    return kind, [os.path.join(trace_dir, n) for n in files]


def load_traces(trace_dir: str, kind: str = "auto", world_size: int | None = None) -> TraceSet:
    """Read every rank's trace in ``trace_dir``; refuse duplicates and missing ranks."""
    kind, paths = _list_traces(trace_dir, kind)
    events, files, metas, worlds, warnings = {}, {}, {}, set(), []
    for path in paths:
        if kind == "recorder":
            meta, evs, notes = read_recorder_trace(path, expected_rank=_rank_from_filename(path))
            warnings += notes
            rank, world = meta["rank"], meta["world_size"]
            metas[rank] = meta
        else:
            rank, world, evs, notes = read_kineto_trace(path)
            warnings += notes
        if rank in files:
            raise ValueError(f"{path}: rank {rank} also has a trace in {files[rank]}; keep one file per rank")
        if world is not None:
            worlds.add(world)
        events[rank], files[rank] = evs, path
    if len(worlds) > 1:
        raise ValueError(f"{trace_dir}: traces disagree on the world size: {sorted(worlds)}")
    world = world_size or (worlds.pop() if worlds else max(files) + 1)
    missing = [r for r in range(world) if r not in files]
    extra = [r for r in files if r >= world]
    if missing or extra:
        raise ValueError(f"{trace_dir}: world size is {world} but traces are missing for ranks {missing}"
                         + (f" and present for out-of-range ranks {extra}" if extra else "")
                         + "; the analysis needs every rank (a missing rank may be the slow one)")
    trace = TraceSet(events=events, world_size=world, source=kind, files=files, warnings=warnings)
    meshes = {json.dumps(m["mesh"], sort_keys=True) for m in metas.values() if m.get("mesh")}
    if len(meshes) > 1:
        raise ValueError(f"{trace_dir}: ranks recorded different mesh sizes: {sorted(meshes)}")
    if meshes:
        trace.mesh_sizes = json.loads(meshes.pop())
    trace.recorded_groups = {r: m["groups"] for r, m in metas.items() if isinstance(m.get("groups"), dict)}
    return trace
