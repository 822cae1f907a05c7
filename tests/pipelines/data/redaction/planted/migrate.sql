-- One-off migration: copy legacy customers into the new schema.
-- Source: postgres://legacy_ro:⟪url_password|hunter2hunter236⟫@legacy-db.example.com:5432/crm
CREATE EXTENSION IF NOT EXISTS dblink;

SELECT dblink_connect('legacy', 'host=legacy-db.example.com dbname=crm user=legacy_ro password=⟪password|N0tMyRealP@ss22⟫');

INSERT INTO customers (id, email, created_at)
SELECT id, email, created_at
FROM dblink('legacy', 'SELECT id, email, created_at FROM customer')
  AS t(id int, email text, created_at timestamptz);

CREATE USER reporting WITH PASSWORD '⟪password|N0tMyRealP@ss11⟫';
GRANT SELECT ON customers TO reporting;
