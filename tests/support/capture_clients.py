"""Helpers that several test modules use (so none imports another), from the tests of: Capture in the
sandbox: clients that ignore the proxy variables go through the proxy anyway."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

TIMEOUT = 180


JAVA = """
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;

public class Client {
    public static void main(String[] args) {
        HttpClient client = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(60)).build();
        StringBuilder out = new StringBuilder("{");
        for (int i = 0; i < args.length; i++) {
            String result;
            try {
                HttpRequest request = HttpRequest.newBuilder(URI.create(args[i]))
                    .timeout(Duration.ofSeconds(60)).build();
                HttpResponse<String> response = client.send(request, HttpResponse.BodyHandlers.ofString());
                String body = response.body();
                int at = body.indexOf("\\"path\\": \\"");
                String path = at < 0 ? "?" : body.substring(at + 9, body.indexOf('"', at + 9));
                result = "[" + response.statusCode() + ", \\"" + path + "\\"]";
            } catch (Exception e) {
                result = "[\\"error\\", \\"" + e.getClass().getSimpleName() + "\\"]";
            }
            out.append(i == 0 ? "" : ", ").append("\\"").append(args[i]).append("\\": ").append(result);
        }
        System.out.println(out.append("}"));
    }
}
"""


def java_trusting(work: Path, ca_file: Path) -> list[str]:
    """`java` running the client from `work` with a PKCS12 trust store holding the test CA (the JVM
    reads no CA-bundle variable)."""
    source = work / "Client.java"
    source.write_text(JAVA)
    store = work / "trust.p12"
    subprocess.run(
        ["keytool", "-importcert", "-noprompt", "-alias", "test", "-file", str(ca_file), "-storetype",
         "PKCS12", "-keystore", str(store), "-storepass", "changeit"],
        check=True, capture_output=True, timeout=TIMEOUT,
    )  # fmt: skip
    trust = [f"-Djavax.net.ssl.trustStore={store}", "-Djavax.net.ssl.trustStorePassword=changeit"]
    return ["java", *trust, "-Djavax.net.ssl.trustStoreType=PKCS12", str(source)]


GO = """
package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"time"
)

func main() {
	pem, err := os.ReadFile(os.Args[1])
	if err != nil {
		panic(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	// Proxy: nil — this transport ignores HTTP_PROXY and friends entirely
	transport := &http.Transport{Proxy: nil, TLSClientConfig: &tls.Config{RootCAs: roots}}
	client := &http.Client{Transport: transport, Timeout: 60 * time.Second}
	out := map[string][]interface{}{}
	for _, url := range os.Args[2:] {
		response, err := client.Get(url)
		if err != nil {
			out[url] = []interface{}{"error", "request failed"}
			continue
		}
		var body struct{ Path string `json:"path"` }
		json.NewDecoder(response.Body).Decode(&body)
		response.Body.Close()
		out[url] = []interface{}{response.StatusCode, body.Path}
	}
	line, _ := json.Marshal(out)
	fmt.Println(string(line))
}
"""


def build_go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Go client, built here with the standard library only (no module download, no network)."""
    directory = tmp_path_factory.mktemp("goclient")
    (directory / "main.go").write_text(GO)
    env = dict(os.environ)
    env.update(
        GOCACHE=str(directory / "cache"),
        GOPATH=str(directory / "gopath"),
        GOFLAGS="-mod=mod",
        GOPROXY="off",
        GO111MODULE="off",
        CGO_ENABLED="0",
    )
    binary = directory / "client"
    subprocess.run(
        ["go", "build", "-o", str(binary), "main.go"],
        cwd=directory,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return binary


