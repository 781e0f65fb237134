"""``/v1/files``: upload (multipart), list, retrieve, content, delete."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.openapi.spec import Link
from litestar.params import FromPath

from server.apidoc.operation import SERVER_ERROR, Answer, Field, Public, RouteDoc, documented
from server.apidoc.request_headers import STRING
from server.envelope.context import principal_tenant
from server.errors import ApiError
from server.http.respond import respond
from server.openai.files.protocol import FileDeleted, FileObject
from server.openai.files.serving import FilesServing
from server.openai.protocol import ListPage

MULTIPART_SLACK = 64 * 1024
"""Room for the form's other fields and boundaries around the file itself."""


def files(request: Request[Any, Any, Any]) -> FilesServing:
    svc: FilesServing = request.app.state.files
    return svc


FILE_ID = {"file_id": "$response.body#/id"}
FILE_LINKS = {
    "retrieve": Link(operation_id="retrieve_file", parameters=FILE_ID),
    "content": Link(operation_id="file_content", parameters=FILE_ID),
    "delete": Link(operation_id="delete_file", parameters=FILE_ID),
    "batch": Link(
        operation_id="create_batch",
        request_body={
            "input_file_id": "$response.body#/id",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    ),
}


# The gateway's body limit does not apply: the file's own limit (checked before anything is
# read, from the declared length) does.
@post(
    "/v1/files",
    opt={"auth": "key"},
    request_max_body_size=None,
    operation_class=documented(
        RouteDoc(
            summary="Upload a batch input file",
            tag="OpenAI batches",
            body={
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "purpose": {"enum": ["batch"]},
                },
            },
            body_media_type="multipart/form-data",
            answers=(Answer(200, Public(FileObject), "The stored file.", links=FILE_LINKS),),
            errors=(400, 401, 411, 413, 429, *SERVER_ERROR),
        )
    ),
)
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


@get(
    "/v1/files",
    opt={"auth": "key"},
    operation_class=documented(
        RouteDoc(
            summary="List files",
            tag="OpenAI batches",
            query=(
                Field("purpose", STRING, "Only files of this purpose."),
                Field("order", {"enum": ["asc", "desc"]}, "By creation time; default `desc`."),
                Field("after", STRING, "A file id: the page after it."),
                Field("limit", {"type": "integer", "minimum": 1, "maximum": 10000}, "Page size."),
            ),
            answers=(Answer(200, ListPage, "One page of files."),),
            errors=(400, 401, 429, *SERVER_ERROR),
        )
    ),
)
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


@get(
    "/v1/files/{file_id:str}",
    opt={"auth": "key"},
    operation_class=documented(
        RouteDoc(
            summary="Retrieve a file",
            tag="OpenAI batches",
            answers=(Answer(200, Public(FileObject), "The file."),),
            errors=(401, 404, 429, *SERVER_ERROR),
        )
    ),
)
async def retrieve_file(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[Any]:
    return respond(await files(request).retrieve(principal_tenant(request), file_id))


@get(
    "/v1/files/{file_id:str}/content",
    opt={"auth": "key"},
    operation_class=documented(
        RouteDoc(
            summary="Retrieve a file's content",
            tag="OpenAI batches",
            answers=(Answer(200, STRING, "The file's bytes (JSON lines).", "application/jsonl"),),
            errors=(401, 404, 429, *SERVER_ERROR),
        )
    ),
)
async def file_content(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[Any]:
    return respond(await files(request).content(principal_tenant(request), file_id))


@delete(
    "/v1/files/{file_id:str}",
    opt={"auth": "key"},
    status_code=200,
    operation_class=documented(
        RouteDoc(
            summary="Delete a file",
            tag="OpenAI batches",
            answers=(Answer(200, FileDeleted, "The file is deleted."),),
            errors=(401, 404, 429, *SERVER_ERROR),
        )
    ),
)
async def delete_file(request: Request[Any, Any, Any], file_id: FromPath[str]) -> Response[Any]:
    return respond(await files(request).delete(principal_tenant(request), file_id))


ROUTES = [create_file, list_files, retrieve_file, file_content, delete_file]
