// Writes the page template of `dvc plots show` (make setup; .dvc/config's plots.html_template names it):
// dvc_render's own page, with vega, vega-lite and vega-embed inlined from docs/node_modules (versions pinned in
// docs/package-lock.json) where dvc_render puts three <script src> tags to a CDN. Usage: node docs/plots_template.mjs OUT
//
// dvc_render fills the template with str.replace of "{scripts}", "{plot_divs}" and "{refresh_tag}" (not
// str.format), so the JS's own braces need no escaping; the template has no {scripts}, so the CDN tags go nowhere.
import { readFileSync, renameSync, writeFileSync } from "node:fs";

const out = process.argv[2];
if (!out) throw new Error("usage: node docs/plots_template.mjs OUT.html");

const inline = (pkg, file) => {
  const { version } = JSON.parse(readFileSync(new URL(`node_modules/${pkg}/package.json`, import.meta.url)));
  let code = readFileSync(new URL(`node_modules/${pkg}/build/${file}`, import.meta.url), "utf8");
  code = code.replace(/\n\/\/# sourceMappingURL=\S+\s*$/, "\n"); // no .map next to the page
  for (const bad of ["{scripts}", "{plot_divs}", "{refresh_tag}", "<!--"]) {
    if (code.includes(bad)) throw new Error(`${pkg}/build/${file} contains ${bad}: it cannot be inlined as is`);
  }
  // "</script" would end the inline element; "<\/script" means the same in JS strings, regexes and comments.
  code = code.replace(/<\/script/gi, "<\\/script");
  return `<script>/* ${pkg}@${version} (npm, inlined: no network) */\n${code}</script>`;
};

const page = `<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
    ${inline("vega", "vega.min.js")}
    ${inline("vega-lite", "vega-lite.min.js")}
    ${inline("vega-embed", "vega-embed.min.js")}
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
`;

writeFileSync(`${out}.tmp`, page);
renameSync(`${out}.tmp`, out); // make's target appears only when complete
console.log(`${out}: ${page.length} characters, vega, vega-lite and vega-embed inlined`);
