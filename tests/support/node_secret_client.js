// HTTPS GETs through the proxy in HTTPS_PROXY with https.request and a CONNECT-tunnel agent, sending
// process.env.API_KEY: to the first URL as `Authorization: Bearer`, to the others as `X-Key`.
// Why: node 20 ignores proxy variables, so agents tunnel by hand; TLS trusts node's roots plus
// NODE_EXTRA_CA_CERTS (egressd's bundle), nothing else.
// Usage: node node_secret_client.js URL...  → one JSON line: [{status, reason} | {error}, ...]
const http = require('http'), https = require('https'), tls = require('tls');
const proxy = new URL(process.env.HTTPS_PROXY);
const auth = 'Basic ' + Buffer.from(decodeURIComponent(proxy.username) + ':' + decodeURIComponent(proxy.password)).toString('base64');

class TunnelAgent extends https.Agent {
  createConnection(options, callback) {
    const target = `${options.host}:${options.port}`;
    const req = http.request({host: proxy.hostname, port: proxy.port, method: 'CONNECT', path: target,
      headers: {'Proxy-Authorization': auth, Host: target}});
    req.on('connect', (res, socket) => {
      if (res.statusCode !== 200) { callback(new Error(`CONNECT ${res.statusCode}`)); return; }
      callback(null, tls.connect({socket, servername: options.servername || options.host}));
    });
    req.on('error', callback);
    req.end();
  }
}

function get(url, headers) { return new Promise((resolve) => {
  const req = https.request(url, {agent: new TunnelAgent(), headers}, (res) => {
    res.resume();
    res.on('end', () => resolve({status: res.statusCode, reason: res.headers['x-egressd-reason'] || null}));
  });
  req.on('error', (e) => resolve({error: String(e.code || e)}));
  req.end();
}); }

(async () => {
  const key = process.env.API_KEY, urls = process.argv.slice(2), results = [];
  for (const [i, url] of urls.entries()) {
    results.push(await get(url, i === 0 ? {Authorization: `Bearer ${key}`} : {'X-Key': key}));
  }
  console.log(JSON.stringify(results));
})();
