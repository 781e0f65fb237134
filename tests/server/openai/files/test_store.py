"""The file stores (local disk, Redis) with an injected clock: tenant scoping, listing
pages, overwrites, deletions and the retention period."""

from __future__ import annotations

from pathlib import Path

from tests.server.openai.conftest import StoresFactory


async def test_files_are_scoped_by_tenant_and_expire_after_the_retention_period(
    make_stores: StoresFactory, store_kind: str, tmp_path: Path
) -> None:
    stores = make_stores(retention_s=3600.0)
    files, clock = stores.files, stores.clock
    upload = await files.create("t", "in.jsonl", "batch", b"{}\n")
    assert upload.expires_at == int(clock.now + 3600)
    assert await files.content("t", upload.id) == b"{}\n"
    assert await files.get("other", upload.id) is None
    assert await files.content("other", upload.id) is None
    assert await files.get("t", "../" + upload.id) is None
    assert not await files.delete("other", upload.id)
    if stores.redis is not None:  # Redis removes it by itself at the end of the period
        keys = [k async for k in stores.redis.scan_iter(f"{stores.prefix}:*file:*")]
        assert len(keys) == 1
        assert 3590_000 < await stores.redis.pttl(keys[0]) <= 3600_000
    clock.now += 3601
    assert await files.get("t", upload.id) is None
    assert await files.content("t", upload.id) is None
    assert await files.list_files("t") == ([], False)
    if store_kind == "disk":
        assert await files.purge_expired() == 1
        assert not any(p.is_file() for p in tmp_path.rglob("*"))  # noqa: ASYNC240


async def test_files_list_in_pages_by_purpose_and_order(make_stores: StoresFactory) -> None:
    stores = make_stores()
    files, clock = stores.files, stores.clock
    ids = []
    for i in range(5):
        clock.now += 1
        purpose = "batch_output" if i == 2 else "batch"
        ids.append((await files.create("t", f"{i}.jsonl", purpose, b"x")).id)
    await files.create("other", "o.jsonl", "batch", b"x")
    newest_first = ids[::-1]
    page, more = await files.list_files("t", limit=2)
    assert [f.id for f in page] == newest_first[:2] and more
    page, more = await files.list_files("t", after=page[-1].id, limit=2)
    assert [f.id for f in page] == newest_first[2:4] and more
    page, more = await files.list_files("t", after=page[-1].id, limit=2)
    assert [f.id for f in page] == newest_first[4:] and not more
    asc, _ = await files.list_files("t", order="asc")
    assert [f.id for f in asc] == ids
    only, _ = await files.list_files("t", purpose="batch_output")
    assert [f.id for f in only] == [ids[2]]
    assert await files.list_files("t", after="file-unknown") == ([], False)
    assert await files.delete("t", ids[1])
    assert not await files.delete("t", ids[1])
    assert await files.get("t", ids[1]) is None
    remaining, more = await files.list_files("t")
    assert [f.id for f in remaining] == [i for i in newest_first if i != ids[1]] and not more


async def test_a_file_written_again_under_its_id_is_replaced(make_stores: StoresFactory) -> None:
    files = make_stores().files
    first = await files.create("t", "out.jsonl", "batch_output", b"a\n", file_id="file-x-output")
    second = await files.create("t", "out.jsonl", "batch_output", b"bb\n", file_id="file-x-output")
    assert first.id == second.id == "file-x-output"
    assert await files.content("t", "file-x-output") == b"bb\n"
    assert (await files.get("t", "file-x-output")).bytes == 3  # type: ignore[union-attr]
    listed, _ = await files.list_files("t")
    assert [f.id for f in listed] == ["file-x-output"]


async def test_two_stores_on_one_storage_see_each_others_files(make_stores: StoresFactory) -> None:
    one, two = make_stores(), make_stores()
    upload = await one.files.create("t", "in.jsonl", "batch", b"line\n")
    assert await two.files.content("t", upload.id) == b"line\n"
    assert [f.id for f in (await two.files.list_files("t"))[0]] == [upload.id]
    assert await two.files.delete("t", upload.id)
    assert await one.files.get("t", upload.id) is None
