"""Megatron's interactive client of the text generation server.

    python tools/text_generation_cli.py localhost:5000

Asks for a prompt and a number of tokens, sends `PUT http://HOST:PORT/api` and prints the text,
until end of input (Ctrl-D) or Ctrl-C. The number is read with int(), where Megatron's
ast.literal_eval would take any Python literal. A refused request prints the server's message
and the loop goes on.
"""

import json
import os
import sys
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli  # noqa: E402


class CliError(ValueError):
    """A bad command line: one line, exit status 1."""


def api_url(address: str) -> str:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise CliError(f"the address must be HOST:PORT, got {address!r}")
    return f"http://{host}:{port}/api"


def request_text(url: str, prompt: str, tokens_to_generate: int) -> str:
    """The generated text, or the line to print when the server refuses or cannot be reached."""
    data = json.dumps({"prompts": [prompt], "tokens_to_generate": tokens_to_generate}).encode("utf-8")
    request = urllib.request.Request(url, data=data, method="PUT", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return "Megatron Response: \n" + json.loads(response.read())["text"][0]
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.reason
        return f"Error {error.code}: {message}"
    except urllib.error.URLError as error:
        return f"Error: cannot reach {url}: {error.reason}"


def main() -> None:
    if len(sys.argv) != 2:
        raise CliError("usage: text_generation_cli.py HOST:PORT")
    url = api_url(sys.argv[1])
    while True:
        try:
            prompt = input("Enter prompt: ")
            answer = input("Enter number of tokens to generate: ")
        except EOFError:
            print()
            return
        try:
            tokens_to_generate = int(answer)
            if tokens_to_generate < 0:
                raise ValueError
        except ValueError:
            print(f"tokens to generate must be a non-negative integer, got {answer!r}")
            continue
        print(request_text(url, prompt, tokens_to_generate), flush=True)


if __name__ == "__main__":
    run_cli(main, "text_generation_cli.py", errors=(CliError,), interrupted="bye")
