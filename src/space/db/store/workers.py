"""Workers: their registration, heartbeats, health figures and the load placed on them."""

from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from space.db import tables as t
from space.db.store.base import Queries, Row
from space.db.store.tenants import _sha256
from space.release import UNVERSIONED

JOIN_PREFIX = "sj_"


@dataclass(frozen=True)
class WorkerLoad:
    """What the sandboxes placed on one worker ask for, from the database."""

    vcpus: int = 0
    memory_mib: int = 0  # their guest RAM
    disk_mib: int = 0
    count: int = 0
    # Those the worker's last measurement may not include (placed or changed since).
    fresh_memory_mib: int = 0
    fresh_count: int = 0
    # Warm-pool members among them: they give their room to a sandbox someone asks for.
    pool_vcpus: int = 0
    pool_memory_mib: int = 0
    pool_count: int = 0


class WorkerQueries(Queries):
    async def create_join_token(self, worker_id: str, ttl: datetime.timedelta) -> str:
        """A token the worker `worker_id` may trade once, within `ttl`, for its certificate;
        only its hash is stored, so this is the one time it can be seen."""
        token = JOIN_PREFIX + secrets.token_urlsafe(32)
        async with self.engine.begin() as c:
            await c.execute(
                t.join_tokens.insert().values(
                    token_sha256=_sha256(token), worker_id=worker_id,
                    expires_at=sa.func.now() + ttl,
                )
            )  # fmt: skip
        return token

    async def redeem_join_token(self, worker_id: str, token: str) -> bool:
        """Spend the token: true once, for the worker it was made for, before it expires."""
        async with self.engine.begin() as c:
            res = await c.execute(
                t.join_tokens.update()
                .where(
                    t.join_tokens.c.token_sha256 == _sha256(token),
                    t.join_tokens.c.worker_id == worker_id,
                    t.join_tokens.c.used_at.is_(None),
                    t.join_tokens.c.expires_at > sa.func.now(),
                )
                .values(used_at=sa.func.now())
            )
            return res.rowcount == 1

    async def register_worker(
        self, worker_id: str, url: str, instance: str, vcpus: int, memory_mib: int,
        version: str = UNVERSIONED,
    ) -> None:  # fmt: skip
        values = {
            "version": version,
            "url": url,
            "state": "active",
            "instance": instance,
            "capacity_vcpus": vcpus,
            "capacity_memory_mib": memory_mib,
            "heartbeat_at": sa.func.now(),
            "registered_at": sa.func.now(),
        }
        async with self.engine.begin() as c:
            await c.execute(
                pg_insert(t.workers)
                .values(id=worker_id, **values)
                .on_conflict_do_update(index_elements=[t.workers.c.id], set_=values)
            )

    async def ready_workers(self) -> int:
        """Workers that can take sandboxes now: active, and with no problem reported."""
        w = t.workers.c
        q = sa.select(sa.func.count()).where(w.state == "active", w.problem.is_(None))
        async with self.engine.connect() as c:
            return int((await c.execute(q)).scalar_one())

    async def workers(self) -> list[Row]:
        async with self.engine.connect() as c:
            return list((await c.execute(sa.select(t.workers))).mappings())

    async def worker(self, worker_id: str) -> Row | None:
        async with self.engine.connect() as c:
            q = sa.select(t.workers).where(t.workers.c.id == worker_id)
            return (await c.execute(q)).mappings().first()

    async def set_draining(self, worker_id: str, draining: bool) -> Row | None:
        """Start or stop draining a worker; its row, None if there is no such worker."""
        q = (t.workers.update().where(t.workers.c.id == worker_id)
             .values(draining=draining).returning(*t.workers.c))  # fmt: skip
        async with self.engine.begin() as c:
            return (await c.execute(q)).mappings().first()

    async def set_worker_state(self, worker_id: str, state: str) -> bool:
        """active or lost (decided by the leader's probes); False if it was so already."""
        w = t.workers.c
        async with self.engine.begin() as c:
            q = t.workers.update().where(w.id == worker_id, w.state != state).values(state=state)
            return (await c.execute(q)).rowcount == 1

    async def worker_health(
        self, worker_id: str, overhead_mib: int, used_memory_mib: int, disk: tuple[int, int],
        problem: str | None, age_s: float = 0.0, mem_available_mib: int | None = None,
        templates: dict[str, str] | None = None, registry: bool = False,
        shares: dict[str, int] | None = None, version: str = UNVERSIONED,
    ) -> None:  # fmt: skip
        """What a probe learnt `age_s` ago: VMM overhead, memory in use as measured, disk
        (capacity, promised), any problem, the host's MemAvailable and the templates it
        holds."""
        w = t.workers.c
        values = {"overhead_mib": overhead_mib, "used_memory_mib": used_memory_mib,
                  "capacity_disk_mib": disk[0], "used_disk_mib": disk[1],
                  "problem": problem, "mem_available_mib": mem_available_mib,
                  "templates": templates or {}, "registry": registry, "shares": shares or {},
                  "version": version,
                  "heartbeat_at": sa.func.now()}  # fmt: skip
        async with self.engine.begin() as c:
            await c.execute(
                t.workers.update()
                .where(w.id == worker_id)
                .values(
                    **values,
                    measured_at=sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, age_s),
                )
            )

    async def worker_load(self) -> dict[str, WorkerLoad]:
        """What the sandboxes on each worker ask for: every sandbox that holds a VM or will need
        one again (a suspended one holds its resume's room). A sandbox in `error` holds nothing:
        its VM is gone or its worker lost. Fresh: placed, started or resumed since the worker
        last measured, so its measurement may not include them."""
        s, w = t.sandboxes.c, t.workers.c
        fresh = sa.or_(w.measured_at.is_(None), s.updated_at >= w.measured_at,
                       s.state.in_(("pending", "starting", "resuming")))  # fmt: skip

        def total(
            column: sa.ColumnElement[int], when: sa.ColumnElement[bool]
        ) -> sa.ColumnElement[int]:
            return sa.func.coalesce(sa.func.sum(sa.case((when, column), else_=0)), 0)

        one = sa.literal(1)
        q = (
            sa.select(
                s.worker_id, sa.func.sum(s.vcpus), sa.func.sum(s.memory_mib),
                sa.func.sum(s.disk_mib), sa.func.count(),
                total(s.memory_mib, fresh), total(one, fresh),
                total(s.vcpus, s.pool), total(s.memory_mib, s.pool), total(one, s.pool),
            )
            .select_from(t.sandboxes.join(t.workers, w.id == s.worker_id))
            .where(s.state.not_in(("deleted", "error")))
            .group_by(s.worker_id)
        )  # fmt: skip
        async with self.engine.connect() as c:
            return {r[0]: WorkerLoad(*map(int, r[1:])) for r in await c.execute(q)}
