"""Create the dev bucket and its lifecycle rules (the bucket Job, kvcloud/tools image).

Idempotent: an existing bucket is kept. The expiration rule (EXPIRATION_DAYS, the gc
CronJob's kvcloud.io/bucket-expiration-days) is a backstop for objects gc missed; a server
that refuses lifecycle rules leaves gc as the only deleter, which is enough (docs/OPERATIONS.md,
"S3 lifecycle"). The credentials come as files (CREDENTIALS_DIR), never as variables.
"""

from __future__ import annotations

import os
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError


def main() -> None:
    bucket = os.environ["BUCKET"]
    days = int(os.environ["EXPIRATION_DAYS"])
    creds = Path(os.environ.get("CREDENTIALS_DIR", "/run/credentials"))
    s3 = boto3.client(
        "s3",
        endpoint_url=os.environ["S3_ENDPOINT"],
        region_name="us-east-1",
        aws_access_key_id=(creds / "access-key").read_text().strip(),
        aws_secret_access_key=(creds / "secret-key").read_text().strip(),
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 10}),
    )
    try:
        s3.create_bucket(Bucket=bucket)
        print(f"bucket {bucket} created")
    except ClientError as exc:
        if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise
        print(f"bucket {bucket} exists")
    rules = [
        {
            "ID": "abort-incomplete-multipart-uploads",
            "Status": "Enabled",
            "Filter": {"Prefix": ""},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
        },
        {
            "ID": "expire-objects",
            "Status": "Enabled",
            "Filter": {"Prefix": ""},
            "Expiration": {"Days": days},
        },
    ]
    try:
        s3.put_bucket_lifecycle_configuration(
            Bucket=bucket, LifecycleConfiguration={"Rules": rules}
        )
        print(f"lifecycle: objects expire after {days} days")
    except ClientError as exc:
        code = exc.response["Error"].get("Code")
        print(f"note: the server refused the lifecycle rules ({code}); gc deletes alone")


if __name__ == "__main__":
    main()
