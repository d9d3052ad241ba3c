"""A local server on 127.0.0.1 that speaks the part of the Hugging Face Hub HTTP API that publishing and loading use.

Endpoints (model repositories only; what `huggingface_hub` 2.4 and `transformers` 5.24 call, read from their
sources `hf_api.py`, `_commit_api.py`, `file_download.py`):
- POST /api/repos/create                                  {"name", "organization"} -> {"url"}; 409 if it exists
- POST /api/validate-yaml                                 README metadata check -> 200, or 400 {"errors": [...]}
- GET  /api/whoami-v2                                     a fixed user
- GET  /api/models/{repo}[/revision/{rev}]                model info: sha, siblings
- POST /api/models/{repo}/preupload/{rev}                 every file "regular" (no LFS / Xet)
- POST /api/models/{repo}/commit/{rev}                    NDJSON: header, file (base64), deletedFile, deletedFolder
- GET  /api/models/{repo}/tree/{rev}[/{path}]             file and directory entries (recursive=true supported)
- POST /api/models/{repo}/paths-info/{rev}                entries of the given paths
- HEAD/GET /{repo}/resolve/{rev}/{path}                   file bytes, with X-Repo-Commit, ETag, Content-Length
Errors carry `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound) as the Hub does, which
`huggingface_hub.utils.hf_raise_for_status` turns into its typed exceptions.
Storage is in memory: each commit is a full snapshot {path: bytes}; branches map to commit ids.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml


GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


class Repo:
    """One model repository: commits (id -> snapshot) and branches (name -> commit id)."""

    def __init__(self, repo_id: str):
        self.repo_id = repo_id
        self.commits: dict[str, dict[str, bytes]] = {}
        self.branches: dict[str, str] = {}
        self.commit({".gitattributes": GITATTRIBUTES}, "main", "initial commit")

    def commit(self, files: dict[str, bytes], branch: str, summary: str) -> str:
        digest = hashlib.sha1(f"{self.repo_id}{len(self.commits)}{summary}{time.time_ns()}".encode())
        for path in sorted(files):
            digest.update(path.encode() + hashlib.sha1(files[path]).digest())
        sha = digest.hexdigest()
        self.commits[sha] = dict(files)
        self.branches[branch] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None


def blob_oid(content: bytes) -> str:
    """The git blob id of `content` (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def validate_metadata(readme: str) -> list[str]:
    """Errors in a README's YAML metadata: a subset of what the Hub's validator rejects (parsable YAML, a mapping,
    string-or-list `tags`/`datasets`/`base_model`/`language`, a `model-index` that `huggingface_hub` parses)."""
    from huggingface_hub.repocard_data import model_index_to_eval_results

    if not readme.startswith("---"):
        return []
    try:
        metadata = yaml.safe_load(readme.split("---", 2)[1])
    except yaml.YAMLError as err:
        return [f"YAML: {err}"]
    if not isinstance(metadata, dict):
        return ["metadata must be a mapping"]
    errors = []
    for key in ("tags", "datasets", "base_model", "language"):
        value = metadata.get(key)
        if value is not None and not (isinstance(value, str) or all(isinstance(v, str) for v in value)):
            errors.append(f"'{key}' must be a string or a list of strings")
    if "model-index" in metadata:
        try:
            name, results = model_index_to_eval_results(metadata["model-index"])
            if not name or not results:
                errors.append("'model-index' needs a name and at least one result")
        except (KeyError, TypeError, ValueError) as err:
            errors.append(f"'model-index' is invalid: {err!r}")
    return errors


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: LocalHub

    def log_message(self, format, *args):  # keep pytest output clean; requests are recorded instead
        pass

    # -- responses ---------------------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, payload, status: int = 200, headers: dict | None = None):
        self._send(status, json.dumps(payload).encode(), headers)

    def _error(self, status: int, code: str | None, message: str):
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json({"error": message}, status, headers)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    # -- routing -----------------------------------------------------------------------------------------------

    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def do_POST(self):
        self._route()

    def _route(self):
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        query = parse_qs(url.query)
        self.server.requests.append((self.command, url.path))
        try:
            if parts[:2] == ["api", "repos"] and parts[2:] == ["create"] and self.command == "POST":
                return self._create_repo()
            if parts[:2] == ["api", "validate-yaml"]:
                errors = validate_metadata(json.loads(self._body()).get("content", ""))
                return self._json({"errors": [{"message": e} for e in errors], "warnings": []}, 400 if errors else 200)
            if parts[:2] == ["api", "whoami-v2"]:
                return self._json({"name": "tester", "type": "user", "orgs": [], "auth": {}})
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api_models(parts[2:], query)
            if "resolve" in parts and parts.index("resolve") in (1, 2):
                i = parts.index("resolve")
                return self._resolve("/".join(parts[:i]), parts[i + 1], "/".join(parts[i + 2 :]))
        except Exception as err:  # report server bugs to the client instead of hanging it
            return self._error(500, None, f"local hub error: {err!r}")
        self.server.unhandled.append((self.command, self.path))
        return self._error(404, None, f"not implemented by the local hub: {self.command} {url.path}")

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.server.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        return repo

    def _create_repo(self):
        payload = json.loads(self._body())
        repo_id = "/".join(p for p in (payload.get("organization"), payload["name"]) if p)
        url = f"{self.server.endpoint}/{repo_id}"
        if repo_id in self.server.repos:
            return self._json({"error": "You already created this model repo", "url": url}, 409)
        self.server.repos[repo_id] = Repo(repo_id)
        return self._json({"url": url, "name": repo_id, "id": repo_id})

    def _api_models(self, rest: list[str], query):
        repo_id = "/".join(rest[:2])
        action = rest[2] if len(rest) > 2 else None
        repo = self._repo(repo_id)
        if repo is None:
            return
        revision = rest[3] if len(rest) > 3 else "main"
        if action in (None, "revision"):
            return self._model_info(repo, revision)
        if action == "preupload":
            files = json.loads(self._body())["files"]
            return self._json(
                {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if action == "commit":
            return self._commit(repo, revision)
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.commits[sha]
        if action == "tree":
            prefix = "/".join(rest[4:]).strip("/")
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            return self._json(self._tree(files, prefix, recursive))
        if action == "paths-info":
            body = self._body()
            try:
                paths = json.loads(body)["paths"]
            except (json.JSONDecodeError, KeyError):
                paths = parse_qs(body.decode()).get("paths", [])
            return self._json([e for e in self._tree(files, "", True) if e["path"] in paths])
        return self._error(404, None, f"unknown action {action}")

    def _model_info(self, repo: Repo, revision: str):
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.commits[sha]
        return self._json(
            {
                "_id": repo.repo_id,
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": sha,
                "private": False,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "lastModified": "2026-01-01T00:00:00.000Z",
                "createdAt": "2026-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": path} for path in sorted(files)],
            }
        )

    @staticmethod
    def _tree(files: dict[str, bytes], prefix: str, recursive: bool) -> list[dict]:
        entries, dirs = [], set()
        for path in sorted(files):
            if prefix and not path.startswith(prefix + "/"):
                continue
            rel = path[len(prefix) + 1 :] if prefix else path
            parents = rel.split("/")[:-1]
            for depth in range(1, len(parents) + 1):
                dirs.add("/".join(([prefix] if prefix else []) + parents[:depth]))
            if recursive or not parents:
                content = files[path]
                entries.append({"type": "file", "path": path, "size": len(content), "oid": blob_oid(content)})
        for d in sorted(dirs):
            if recursive or "/" not in d[len(prefix) + 1 if prefix else 0 :]:
                entries.append({"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()})
        return entries

    def _commit(self, repo: Repo, revision: str):
        if "ndjson" not in (self.headers.get("Content-Type") or ""):
            return self._error(400, None, "commit payload must be application/x-ndjson")
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = dict(repo.commits[sha])
        summary = ""
        for line in self._body().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value.get("summary", "")
            elif key == "file":
                if value.get("encoding") != "base64":
                    return self._error(400, None, f"unsupported encoding {value.get('encoding')}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    return self._error(404, "EntryNotFound", "A file with this name doesn't exist")
            elif key == "deletedFolder":
                files = {p: c for p, c in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            else:
                return self._error(400, None, f"the local hub takes regular uploads only, got {key!r}")
        new_sha = repo.commit(files, revision, summary)
        self.server.commits.append((repo.repo_id, summary, sorted(files)))
        url = f"{self.server.endpoint}/{repo.repo_id}/commit/{new_sha}"
        return self._json({"commitUrl": url, "commitOid": new_sha, "pullRequestUrl": None})

    def _resolve(self, repo_id: str, revision: str, path: str):
        repo = self._repo(repo_id)
        if repo is None:
            return
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        content = repo.commits[sha].get(path)
        if content is None:
            return self._error(404, "EntryNotFound", f"Entry not found: {path}")
        headers = {"X-Repo-Commit": sha, "ETag": f'"{blob_oid(content)}"', "Accept-Ranges": "bytes"}
        return self._send(200, content, headers, content_type="application/octet-stream")


class LocalHub(ThreadingHTTPServer):
    """The server; `endpoint` is its base URL (set `HF_ENDPOINT` to it before importing `huggingface_hub`).

    `requests` records (method, path) of every request, `unhandled` those it did not implement, `commits`
    (repo id, summary, files after the commit) of every commit.
    """

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.commits: list[tuple[str, str, list[str]]] = []
        self._thread: threading.Thread | None = None

    def start(self) -> LocalHub:
        self._thread = threading.Thread(target=self.serve_forever, name="local-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def file(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        """Bytes of `path` at `revision` (for assertions)."""
        repo = self.repos[repo_id]
        return repo.commits[repo.resolve(revision)][path]
