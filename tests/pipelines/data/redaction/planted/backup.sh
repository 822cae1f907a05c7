#!/usr/bin/env bash
# Nightly backup of the orders database to object storage.
set -euo pipefail

export PGPASSWORD=⟪password|s3cr3t-Pa5521⟫
export AWS_ACCESS_KEY_ID=⟪aws_access_key|AKIADMMOX7S5AE182KGV⟫
export AWS_SECRET_ACCESS_KEY=⟪secret|+Ya06zdodIPyxzXpIBzHrUsNkl9M01QzFEMIXMvy⟫

pg_dump -h 198.51.100.23 -U backup orders | gzip > /tmp/orders.sql.gz
aws s3 cp /tmp/orders.sql.gz s3://orders-backups/$(date +%F).sql.gz

curl -sf -H "Authorization: Bearer ⟪bearer_token|MzOIvorXbmvHXwR43sDxzHzrO5kncNqKKAwpkuJY⟫" \
  https://status.example.net/api/v1/heartbeat/backup
mysql --user=root --password=⟪password|correcthorse9903⟫ -h ⟪ip_address|203.0.113.7⟫ -e "FLUSH LOGS"
ssh root@⟪ip_address|203.0.113.41⟫ 'systemctl restart backup-agent'
