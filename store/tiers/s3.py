"""S3Tier: an S3-compatible object store through pyarrow's S3FileSystem.

URI: `s3://bucket/prefix?endpoint_override=host:port&scheme=http` plus optional `region`,
`anonymous` (true | false; default: anonymous unless AWS credentials are in the environment)
and `create_bucket` (true | false, default true). Credentials come from the AWS SDK's usual
environment, never from the URI, so URIs can be logged and stored in Redis.

An S3 PUT is atomic, so objects are written in place. AWS_REQUEST_CHECKSUM_CALCULATION is set
to WHEN_REQUIRED before pyarrow initialises S3: otherwise some servers (SeaweedFS) store the
chunked upload's trailers as data (shared/FINDINGS.md). AWS_RESPONSE_CHECKSUM_VALIDATION too:
by default the SDK hashes every GET's body for a checksum it may validate, which cost a load
0.51 s of CPU per GB read against 0.30 without (2-core box, SeaweedFS, 8 MB ranged GETs); loads
check every chunk's xxh3 against the manifest regardless. An operator's own setting stands.
"""

from __future__ import annotations

import logging
import os
import threading
from urllib.parse import parse_qsl, urlsplit

from ctxcache.store.tiers.arrow import ArrowTier
from ctxcache.store.tiers.base import TierConfig

log = logging.getLogger("ctxcache.store.tiers")
_OPTIONS = ("endpoint_override", "scheme", "region", "anonymous", "create_bucket")
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE")


def _flag(uri: str, name: str, value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"object store URI {uri!r}: {name}={value!r} must be true or false")
    return value.lower() in ("true", "1")


def parse_s3_uri(uri: str) -> tuple[str, str, dict[str, str]]:
    """-> (bucket, prefix, options); ValueError names what is wrong."""
    u = urlsplit(uri)
    if u.scheme != "s3" or not u.netloc:
        raise ValueError(f"object store URI {uri!r} must look like s3://bucket/prefix?endpoint_override=host:port")
    if "@" in u.netloc:
        raise ValueError(f"object store URI {uri!r}: put credentials in the environment "
                         "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), not in the URI")
    opts = dict(parse_qsl(u.query, keep_blank_values=True, strict_parsing=bool(u.query)))
    unknown = sorted(set(opts) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"object store URI {uri!r}: unknown option(s) {unknown}; known: {list(_OPTIONS)}")
    if opts.get("scheme", "https") not in ("http", "https"):
        raise ValueError(f"object store URI {uri!r}: scheme={opts['scheme']!r} must be http or https")
    return u.netloc, u.path.strip("/"), opts


_init_lock = threading.Lock()


def _s3_filesystem(uri: str, opts: dict[str, str], config: TierConfig):  # noqa: ANN202 (pyarrow.fs.S3FileSystem)
    with _init_lock:  # before pyarrow's first S3 use in this process (the SDK reads it at init)
        os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "WHEN_REQUIRED")
        os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "WHEN_REQUIRED")
        from pyarrow import fs
    anonymous = opts.get("anonymous")
    anon = (_flag(uri, "anonymous", anonymous) if anonymous is not None
            else not any(os.environ.get(k) for k in _CREDENTIAL_ENV))
    kw = {k: opts[k] for k in ("endpoint_override", "scheme", "region") if k in opts}
    return fs.S3FileSystem(
        anonymous=anon, allow_bucket_creation=True, connect_timeout=config.connect_timeout_s,
        request_timeout=config.request_timeout_s,
        retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=config.max_attempts), **kw)


class S3Tier(ArrowTier):
    scheme = "s3"

    def __init__(self, uri: str, config: TierConfig = TierConfig()) -> None:
        bucket, prefix, opts = parse_s3_uri(uri)
        self.bucket = bucket
        self._create_bucket = _flag(uri, "create_bucket", opts.get("create_bucket", "true"))
        self._bucket_ok = False
        root = f"{bucket}/{prefix}" if prefix else bucket
        super().__init__(uri, config, _s3_filesystem(uri, opts, config), root)

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self.path(key)
        try:
            self._ensure_bucket()
            with self.fs.open_output_stream(path) as f:
                f.write(data)
        except OSError as exc:
            raise self.unavailable("put", key, exc) from None

    def _ensure_bucket(self) -> None:
        """Create the bucket on the first write if allowed (once: it is a request per call)."""
        if self._bucket_ok or not self._create_bucket:
            return
        self.fs.create_dir(self.bucket)
        self._bucket_ok = True
