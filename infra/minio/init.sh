#!/bin/sh
# One-shot MinIO setup for the compose stack (runs in the minio/mc image, POSIX sh):
#  1. the bucket the workers write to (KVCLOUD_BUCKET),
#  2. a lifecycle rule aborting incomplete multipart uploads after
#     ABORT_INCOMPLETE_UPLOADS_DAYS days (S3, Ceph RGW, Garage, SeaweedFS honour it; MinIO
#     accepts the rule but aborts stale uploads itself, per MINIO_API_STALE_UPLOADS_EXPIRY
#     on the minio service),
#  3. an S3 user for the workers (KVCLOUD_S3_ACCESS_KEY) limited to that bucket, so the
#     workers never hold the root credentials.
# Idempotent: running it again changes nothing.
set -eu

: "${MINIO_ENDPOINT:?}" "${MINIO_ROOT_USER:?}" "${MINIO_ROOT_PASSWORD:?}"
: "${KVCLOUD_BUCKET:?}" "${KVCLOUD_S3_ACCESS_KEY:?}" "${KVCLOUD_S3_SECRET_KEY:?}"
DAYS="${ABORT_INCOMPLETE_UPLOADS_DAYS:-1}"

mc alias set local "$MINIO_ENDPOINT" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null
mc mb --ignore-existing "local/$KVCLOUD_BUCKET"

cat >/tmp/lifecycle.json <<JSON
{
  "Rules": [
    {
      "ID": "abort-incomplete-multipart-uploads",
      "Status": "Enabled",
      "Filter": {"Prefix": ""},
      "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": $DAYS}
    }
  ]
}
JSON
if ! mc ilm rule import "local/$KVCLOUD_BUCKET" </tmp/lifecycle.json; then
    echo "note: the server refused the AbortIncompleteMultipartUpload rule;" \
        "MinIO aborts stale uploads itself (MINIO_API_STALE_UPLOADS_EXPIRY)" >&2
fi

cat >/tmp/kvcloud-policy.json <<JSON
{
  "Version": "2012-10-17",
  "Statement": [
    {
      "Effect": "Allow",
      "Action": ["s3:GetBucketLocation", "s3:ListBucket", "s3:ListBucketMultipartUploads"],
      "Resource": ["arn:aws:s3:::$KVCLOUD_BUCKET"]
    },
    {
      "Effect": "Allow",
      "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                 "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
      "Resource": ["arn:aws:s3:::$KVCLOUD_BUCKET/*"]
    }
  ]
}
JSON
mc admin policy create local kvcloud-worker /tmp/kvcloud-policy.json >/dev/null
mc admin user add local "$KVCLOUD_S3_ACCESS_KEY" "$KVCLOUD_S3_SECRET_KEY" >/dev/null
mc admin policy attach local kvcloud-worker --user "$KVCLOUD_S3_ACCESS_KEY" >/dev/null 2>&1 \
    || true  # already attached on a re-run
echo "bucket $KVCLOUD_BUCKET ready; user $KVCLOUD_S3_ACCESS_KEY has policy kvcloud-worker"
