"""Developer services rankflow can start locally: a SeaweedFS S3 server, a PostgreSQL cluster, a Prefect server."""
