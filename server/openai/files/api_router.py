"""``/v1/files``: upload (multipart), list, retrieve, content, delete."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.params import FromPath

from server.errors import ApiError
from server.openai.files.serving import FilesServing
from server.openai.routing import principal_tenant, respond

MULTIPART_SLACK = 64 * 1024
"""Room for the form's other fields and boundaries around the file itself."""


def files(request: Request[Any, Any, Any]) -> FilesServing:
    svc: FilesServing = request.app.state.files
    return svc


# The gateway's body limit does not apply: the file's own limit (checked before anything is
# read, from the declared length) does.
@post("/v1/files", request_max_body_size=None, opt={"auth": "key"})
async def create_file(request: Request[Any, Any, Any]) -> Response[Any]:
    tenant = principal_tenant(request)
    svc = files(request)
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        raise ApiError(411, "Send the upload with a Content-Length.", code="length_required")
    if int(declared) > svc.max_bytes + MULTIPART_SLACK:
        raise svc.too_large(int(declared))
    form = await request.form()
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(
            400,
            "A multipart field `file` holding the file is required.",
            param="file",
            code="invalid_value",
        )
    data = await upload.read()
    return respond(await svc.upload(tenant, upload.filename, form.get("purpose"), data))


@get("/v1/files", opt={"auth": "key"})
async def list_files(request: Request[Any, Any, Any]) -> Response[Any]:
    q = request.query_params
    reply = await files(request).list_files(
        principal_tenant(request),
        purpose=q.get("purpose"),
        order=q.get("order"),
        after=q.get("after"),
        limit=q.get("limit"),
    )
    return respond(reply)


@get("/v1/files/{file_id:str}", opt={"auth": "key"})
async def retrieve_file(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[Any]:
    return respond(await files(request).retrieve(principal_tenant(request), file_id))


@get("/v1/files/{file_id:str}/content", opt={"auth": "key"})
async def file_content(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[Any]:
    return respond(await files(request).content(principal_tenant(request), file_id))


@delete("/v1/files/{file_id:str}", status_code=200, opt={"auth": "key"})
async def delete_file(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[Any]:
    return respond(await files(request).delete(principal_tenant(request), file_id))


ROUTES = [create_file, list_files, retrieve_file, file_content, delete_file]
