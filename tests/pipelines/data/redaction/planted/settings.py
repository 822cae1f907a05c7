"""Django settings for the billing service (staging)."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "⟪secret|django-insecure-70txsl__8*rhbpy+0q6u^(=zi9dimj_89(nv8h_^⟫"
DEBUG = False
ALLOWED_HOSTS = ["billing.staging.internal", "127.0.0.1"]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "billing",
        "USER": "billing_app",
        "PASSWORD": "⟪password|s3cr3t-Pa5546⟫",
        "HOST": "db.staging.internal",
        "PORT": 5432,
    }
}

CELERY_BROKER_URL = "amqp://billing:⟪url_password|s3cr3t-Pa5587⟫@rabbit.staging.internal:5672/billing"
CACHES = {"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://:⟪url_password|OMjRZA0G6vbBxKd5WVwd9ExL⟫@cache.staging.internal:6379/1"}}

AWS_ACCESS_KEY_ID = "⟪aws_access_key|AKIAAZPH9NP7XDRERM98⟫"
AWS_SECRET_ACCESS_KEY = "⟪secret|qGNSOvQmIQbgSc7I8gzNHj+crZ+YxzGtoBgNOOgu⟫"
AWS_STORAGE_BUCKET_NAME = "billing-staging-invoices"

STRIPE_API_KEY = "⟪api_token|sk_live_7AfSXt1qQzEeIfIOpoI9qKkZ⟫"
SENTRY_DSN = os.environ.get("SENTRY_DSN")
EMAIL_HOST_PASSWORD = os.environ["EMAIL_HOST_PASSWORD"]
ADMINS = [("Ops", "⟪email|ops-oncall@billing-example.com⟫")]


def get_connection_password():
    password = os.environ.get("DB_PASSWORD", "")
    return password
