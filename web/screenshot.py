#!/usr/bin/env python3
"""The page's test: serves web/ on localhost, opens it in headless Chromium through chromedriver (the
WebDriver protocol, standard library only), waits until the page reports "done", checks that every
check passed and that the adapter, the results and a heat map per head rendered, and saves a
screenshot.

    web/build && python3 web/screenshot.py [--out web/screenshot.png] [--steps 60]

With --bench FILE it then runs the fused and unfused kernels on the page for a set of shapes and
writes their checks and timings as JSON (the browser figures of BENCHMARKS.md).
"""

import argparse
import base64
import functools
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

WEB = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port):
    class Handler(http.server.SimpleHTTPRequestHandler):
        # .wasm must be served as application/wasm for streaming compilation.
        extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                          ".wasm": "application/wasm", ".js": "text/javascript"}

        def log_message(self, *args):
            pass

    handler = functools.partial(Handler, directory=WEB)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def webdriver(base, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["value"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(WEB, "screenshot.png"))
    parser.add_argument("--steps", type=int, default=60, help="training steps before the heat map")
    parser.add_argument("--timeout", type=float, default=480)
    parser.add_argument("--bench", help="also time the kernels on the page; JSON to this file")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(WEB, "pkg", "wgpu_attention_web_bg.wasm")):
        sys.exit("web/pkg is missing: run web/build first")

    server = serve(free_port())
    driver_port = free_port()
    driver = subprocess.Popen([os.environ.get("CHROMEDRIVER", "chromedriver"), f"--port={driver_port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{driver_port}"
    try:
        for _ in range(100):
            try:
                webdriver(base, "GET", "/status")
                break
            except OSError:
                time.sleep(0.1)
        with open(os.path.join(WEB, "..", "crates", "serve", "webdriver.json")) as f:
            options = json.load(f)["goog:chromeOptions"]
        options["args"] = options["args"] + ["--window-size=1200,1700"]
        session = webdriver(base, "POST", "/session", {
            "capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}
        })["sessionId"]
        s = f"/session/{session}"
        # No training in the background once done: it would share the device with --bench.
        url = f"http://127.0.0.1:{server.server_address[1]}/?steps={args.steps}&repeats=3&background=0"
        webdriver(base, "POST", s + "/timeouts", {"script": 1_800_000})
        webdriver(base, "POST", s + "/url", {"url": url})
        script = lambda js: webdriver(base, "POST", s + "/execute/sync", {"script": js, "args": []})
        deadline = time.time() + args.timeout
        status = ""
        while time.time() < deadline:
            status = script("return document.getElementById('status').textContent")
            if status.startswith("done") or status.startswith("error"):
                break
            time.sleep(1)
        shot = webdriver(base, "GET", s + "/screenshot")
        with open(args.out, "wb") as f:
            f.write(base64.b64decode(shot))
        rendered = script("""return {
            adapter: document.querySelectorAll('#adapter tr').length,
            checks: document.querySelectorAll('#attention .pass').length,
            maps: document.querySelectorAll('#maps canvas').length,
            text: document.getElementById('attention').innerText }""")
        if args.bench and status.startswith("done"):
            runs = []
            for mask in ["none", "causal"]:
                for dim in [32, 64]:
                    for length in [128, 256, 512]:
                        run = webdriver(base, "POST", s + "/execute/async", {"script": f"""
                            const done = arguments[arguments.length - 1];
                            window.demo.run_attention({length}, {dim}, "{mask}", 5)
                                .then((r) => done(r), (e) => done(JSON.stringify({{error: String(e)}})));
                            """, "args": []})
                        runs.append(json.loads(run))
                        print(json.dumps(runs[-1]), flush=True)
            with open(args.bench, "w") as f:
                json.dump({"adapter": script("return window.demo.adapter()"), "runs": runs}, f, indent=1)
        webdriver(base, "DELETE", s)
    finally:
        driver.terminate()
        server.shutdown()

    print(f"status: {status}")
    print(f"screenshot: {args.out}")
    print(rendered["text"])
    problems = []
    if status != "done: every check passed":
        problems.append(f"the page ended with status {status!r}")
    if rendered["adapter"] < 5:
        problems.append("the adapter table did not render")
    if rendered["checks"] != 4:
        problems.append(f"{rendered['checks']} of 4 checks passed")
    if rendered["maps"] != 4:
        problems.append(f"{rendered['maps']} heat maps of 4 rendered")
    if problems:
        sys.exit("page test failed: " + "; ".join(problems))
    print("page test passed: adapter, 4 checks, 4 heat maps")


if __name__ == "__main__":
    main()
