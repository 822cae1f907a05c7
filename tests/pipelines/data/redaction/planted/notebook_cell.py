# cell 3: pull the evaluation results from the tracking server
import requests

session = requests.Session()
session.auth = ("eval-bot", "⟪password|kT7$vB2qYw14⟫")
session.headers["Authorization"] = "token ⟪github_token|gho_lSb8Vzk6q5jI9QJXC8JBll5vlJZ1mcnrE95V⟫"
resp = session.get("https://tracking.example.com/api/runs?api_key=⟪secret|2tVv8k8Qd7p8rqVognV1ysFxsfM1T3tQ⟫&limit=50")

ssh_key = """⟪private_key|-----BEGIN OPENSSH PRIVATE KEY-----
p5nGknZeZ74q2ZAKiBlaRKgfAfIWOmIyMQ4DWXjmWBYh9n95ssohMDh2HZ3xYcdh
F19ffQzC/aEkHpda6P0ZLbjEmB2oATaSW3BIvT0UhnEqG052xpEfE+1Cnb69LYy+
as+Ytb98c1/cBYgzR/mbs9M0JF3DN4qNNxNmAshm2u9JmGgMjfFPYAQXTzOqNYhS
y11nPQuSOfldzSwqjWSCbR0bYvmOFP+G3eV6Rz+cxfv+jzOvltbtqL/3oVO/aFL4
rDLMT0qdhWfVtQHiA7Jgz4h8EGAcWJMsfCW64TCa3NaAuWZPE67Ku1XwYX+7/n7z
mURv3oiK89fwh3E94DMKjqM/U1aIVjkqC22LG63ivdkkuZKixQ+g0vfDOJpuaeS1
lKGGj9QoiaeRZCoUbqbnE8ZzPKIhY1w5JrArqWxiFWBN/cg90UUzc4unNTcDK/1y
wPkHs2YRv6tgnLPpYEu0NEt7lIqmzQH1
-----END OPENSSH PRIVATE KEY-----⟫"""
print(len(resp.json()["runs"]))
