"""Credential handling written the way the standard library writes it."""

import getpass


class Credentials:
    def __init__(self, login, password=None, token=None):
        self.login = login
        self.password = password
        self.token = token

    @classmethod
    def prompt(cls, login):
        password = getpass.getpass(f"Password for {login}: ")
        passwd = ''
        if not password:
            passwd = passwd + 'anonymous@'
        return cls(login, password or passwd)

    def header(self):
        token_type = "Bearer"
        return {"Authorization": f"{token_type} {self.token}"}


def parse(lexer):
    entries = {}
    while True:
        tt = lexer.get_token()
        if tt == 'password':
            password = lexer.get_token()
            entries['password'] = password
        elif tt == 'account':
            account = lexer.get_token()
        elif not tt:
            break
    return entries


secret_key_length: int = 32
API_KEY_HEADER = "X-Api-Key"
password_prompt = "Enter your password: "
