"""The engine's live request groups: by the caller's request id, and by each member request's id
(a group's `n` samples, and the shared prefill that computes their prompt once)."""
from __future__ import annotations

from treeserve.engine.request import RequestGroup


class RequestGroups:
    def __init__(self):
        self.by_id: dict[str, RequestGroup] = {}
        self._of_member: dict[str, RequestGroup] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def get(self, request_id: str) -> RequestGroup | None:
        return self.by_id.get(request_id)

    def is_live(self, group: RequestGroup) -> bool:
        """Still registered (an abort frees an id that a new request may take: that is another group)."""
        return self.by_id.get(group.request_id) is group

    def add(self, group: RequestGroup) -> None:
        self.by_id[group.request_id] = group
        for child in group.children:
            self._of_member[child.request_id] = group

    def add_member(self, request_id: str, group: RequestGroup) -> None:
        self._of_member[request_id] = group

    def drop_member(self, request_id: str) -> None:
        self._of_member.pop(request_id, None)

    def of(self, request_id: str) -> RequestGroup:
        return self._of_member[request_id]

    def pop(self, request_id: str) -> RequestGroup | None:
        """Removes a group and its members; None when it is not (or no longer) registered."""
        group = self.by_id.pop(request_id, None)
        if group is not None:
            for member in group.members():
                self._of_member.pop(member.request_id, None)
        return group
