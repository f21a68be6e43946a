"""A real headless Chromium, driven over the DevTools protocol with plain websockets (no
browser-automation package, nothing downloaded): for the playground's end-to-end tests. Its
fake microphone plays a speech file, once, at real time."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from websockets.sync.client import connect


# DevTools' answers to a question asked of a page that navigated meanwhile (a link was followed)
NAVIGATED = ("Inspected target navigated or closed", "Execution context was destroyed")


def find_chromium() -> str | None:
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


class Browser:
    def __init__(self, executable: str, microphone: Path | None = None, timeout: float = 30.0,
                 extra_args: tuple[str, ...] = ()):
        self.profile = Path(tempfile.mkdtemp(prefix="asrserve-chromium-"))
        self.log = open(self.profile / "browser.log", "w+")
        args = [
            executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", f"--user-data-dir={self.profile}",
            "--remote-debugging-port=0",
            # getUserMedia is granted without a prompt, and the microphone is a file
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            "--autoplay-policy=no-user-gesture-required",
        ]
        if microphone is not None:
            args.append(f"--use-file-for-fake-audio-capture={microphone}%noloop")
        args += extra_args
        self.process = subprocess.Popen([*args, "about:blank"], stdout=self.log, stderr=subprocess.STDOUT)
        self.console: list[str] = []  # the page's console output and uncaught errors, for failure messages
        self.next_id = 0
        self.connection = connect(self._devtools_url(timeout), max_size=None, open_timeout=timeout)
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Runtime.enable", page=True)
        self.call("Page.enable", page=True)

    def _devtools_url(self, timeout: float) -> str:
        """Chromium writes the port it took (and the browser endpoint's path) once it listens."""
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}:\n{self.logs()}")
            lines = port_file.read_text().split() if port_file.exists() else []
            if len(lines) == 2:
                return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
            time.sleep(0.1)
        raise TimeoutError(f"chromium did not open its DevTools port:\n{self.logs()}")

    def call(self, method: str, page: bool = False, timeout: float = 60.0, **params) -> dict:
        """One DevTools command (on the page's session when `page`); its result."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if page:
            message["sessionId"] = self.session
        self.connection.send(json.dumps(message))
        while True:
            reply = json.loads(self.connection.recv(timeout=timeout))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self._record(reply)

    def _record(self, event: dict) -> None:
        params = event.get("params", {})
        if event.get("method") == "Runtime.consoleAPICalled":
            args = (arg.get("value", arg.get("description", "")) for arg in params["args"])
            self.console.append(f"console.{params['type']}: " + " ".join(map(str, args)))
        elif event.get("method") == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.console.append("uncaught: " + details.get("exception", {}).get("description", details["text"]))

    def evaluate(self, expression: str):
        """The expression's value in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", page=True, expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}\n{self.console}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        """Polls until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError as error:  # the page navigated while it was being asked: ask the new one
                if not any(reason in str(error) for reason in NAVIGATED):
                    raise
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"still false after {timeout} s: {expression}\npage console: {self.console}")

    def open(self, url: str) -> None:
        self.call("Page.navigate", page=True, url=url)
        self.wait_for("document.readyState === 'complete'")

    def set_files(self, selector: str, *paths: Path) -> None:
        """Chooses files in an <input type=file>, as a person would (its change event fires)."""
        handle = self.call("Runtime.evaluate", page=True, expression=f"document.querySelector({json.dumps(selector)})")
        self.call("DOM.setFileInputFiles", page=True, objectId=handle["result"]["objectId"],
                  files=[str(path) for path in paths])

    def logs(self) -> str:
        self.log.flush()
        return (self.profile / "browser.log").read_text()

    def close(self) -> None:
        try:
            self.connection.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)
