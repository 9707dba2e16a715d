"""What the repository index and readiness say on Ray Serve: the union of what every live replica reports.

Each model replica runs its own `ModelRepository` and reports its index (the models it has loaded, is loading or
failed to load, with their reasons) after every change and at each health check. `ReplicaReports` (the state
deployment) keeps the latest report of each replica and forgets a replica that stops reporting (killed, its node
gone) after `REPORT_TTL` seconds or at once when it shuts down. `merge_index` turns the reports into the protocol's
index entries; the ingress answers ``/v2/repository/index`` and readiness from them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

__all__ = ["REPORT_TTL", "Entry", "ReplicaReports", "failed", "merge_index", "reportable"]

#: A replica that has not reported for this long is taken as gone (the health check reports every 2 s).
REPORT_TTL = 10.0

# Precedence of a version's states across replicas: it is READY if any replica serves it.
_RANK = {"READY": 0, "LOADING": 1, "UNLOADING": 2, "UNAVAILABLE": 3}
_UNLOADED = "unloaded"

Entry = dict[str, str]


def reportable(entries: Iterable[Entry]) -> list[Entry]:
    """The entries of a replica's own index worth reporting: states, not bare names or LRU unloads (a model that no
    replica holds is available on demand, so the merged index lists it by name only)."""
    return [e for e in entries if "state" in e and not (e["state"] == "UNAVAILABLE" and e.get("reason") == _UNLOADED)]


def merge_index(names: Iterable[str], reports: Iterable[list[Entry]], *, ready_only: bool) -> list[Entry]:
    """The index of the whole application: `names` (the repository's models) and every reported model, each version
    in its best state across replicas (with that replica's reason), ``{"name"}`` for a model no replica holds."""
    versions: dict[str, dict[str, Entry]] = {}
    failures: dict[str, Entry] = {}
    for entries in reports:
        for entry in entries:
            name = entry["name"]
            if "version" not in entry:
                failures.setdefault(name, entry)
                continue
            known = versions.setdefault(name, {})
            current = known.get(entry["version"])
            if current is None or _RANK[entry["state"]] < _RANK[current["state"]]:
                known[entry["version"]] = entry
    merged: list[Entry] = []
    for name in sorted({*names, *versions, *failures}):
        found = versions.get(name, {})
        serving = any(entry["state"] == "READY" for entry in found.values())
        if not found and name not in failures:
            if not ready_only:
                merged.append({"name": name})
            continue
        if name in failures and not serving and not ready_only:
            merged.append(dict(failures[name]))
        for version in sorted(found, key=int):
            entry = found[version]
            if not ready_only or entry["state"] == "READY":
                merged.append(dict(entry))
    return merged


def failed(merged: Iterable[Entry]) -> bool:
    """Whether a model has a version or a model entry that is unavailable for a reason other than an unload."""
    return any(e.get("state") not in (None, "READY") and e.get("reason", "") != _UNLOADED for e in merged)


class ReplicaReports:
    """The latest index report of each model replica (the state deployment's whole state: one replica, no CPU)."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, list[Entry]]] = {}

    def report(self, replica: str, entries: list[Entry]) -> None:
        self._reports[replica] = (time.monotonic(), entries)

    def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def live(self) -> Mapping[str, list[Entry]]:
        """The reports of replicas heard from within `REPORT_TTL` (older ones are dropped)."""
        now = time.monotonic()
        for replica in [r for r, (at, _) in self._reports.items() if now - at > REPORT_TTL]:
            del self._reports[replica]
        return {replica: entries for replica, (_, entries) in self._reports.items()}
