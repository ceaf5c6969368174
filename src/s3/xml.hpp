// The small XML documents S3 answers with (ListObjectsV2, multipart, errors),
// parsed by expat into a tree. Bytes come from the network: the depth, the
// number of elements and the text are bounded, and a malformed document is an
// error naming what was being parsed.
#pragma once

#include <string>
#include <vector>

#include "ferry/status.hpp"

namespace ferry::s3 {

struct XmlNode {
  std::string name;  // local name: any namespace prefix is dropped
  std::string text;  // character data directly inside this element
  std::vector<XmlNode> children;

  // The first child named `name`, or nullptr.
  const XmlNode* child(const std::string& name) const;
  // The text of the first child named `name`, or "" when there is none.
  std::string child_text(const std::string& name) const;
};

// `what` names the document in errors ("ListObjectsV2 of bucket b").
Result<XmlNode> parse_xml(const std::string& doc, const std::string& what);

// Escapes &, <, >, " and ' for element text.
std::string xml_escape(const std::string& s);

}  // namespace ferry::s3
